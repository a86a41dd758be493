"""YAML output of rendered objects, about ten times faster than PyYAML's dumper.

The objects are plain data (dicts, lists, strings, numbers, booleans, None), so block YAML can be
written directly: a string is written plain only when both PyYAML and kubectl (tetrad.api.scalars) read
it back as that same string, else as a JSON string, which is valid double-quoted YAML. Round-trip
tests: tests/api/test_hostile.py.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

import yaml

from tetrad.api.manifest import reads_as_string

_PLAIN = re.compile(r"[A-Za-z0-9_/.][A-Za-z0-9_./=+@-]*(?:[ :][A-Za-z0-9_./=+@-]+)*")
_STR_TAG = "tag:yaml.org,2002:str"
# What a YAML stream may not hold as is (json.dumps already escaped the C0 controls), and the
# Unicode line breaks and BOM, which would end or fold a double-quoted line: written as \uXXXX.
_UNPRINTABLE = re.compile("[^\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufefe\uff00-\ufffd"
                          "\U00010000-\U0010ffff]")
_resolver = yaml.resolver.Resolver()


@lru_cache(maxsize=65536)
def _string(s: str) -> str:
    if (_PLAIN.fullmatch(s) and ": " not in s and not s.endswith(":") and reads_as_string(s)
            and _resolver.resolve(yaml.ScalarNode, s, (True, False)) == _STR_TAG):  # type: ignore[no-untyped-call]
        return s
    return _UNPRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(s, ensure_ascii=False))


def _scalar(v: Any) -> str:
    if isinstance(v, str):
        return _string(v)
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        text = repr(v)
        if "e" in text and "." not in text:  # YAML 1.1 floats need a dot: 1e-05 -> 1.0e-05
            mantissa, exponent = text.split("e")
            text = f"{mantissa}.0e{exponent if exponent[0] in '+-' else '+' + exponent}"
        return {"inf": ".inf", "-inf": "-.inf", "nan": ".nan"}.get(text, text)
    if isinstance(v, dict) and not v:
        return "{}"
    if isinstance(v, list) and not v:
        return "[]"
    raise TypeError(f"cannot write {type(v).__name__} as YAML")


_LITERAL_UNSAFE = re.compile("[^\n\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufefe\uff00-\ufffd"
                             "\U00010000-\U0010ffff]|[ \t]\n|[ \t]$")


def _literal(s: str, head: str, indent: int, out: list[str]) -> bool:
    """Write a multi-line string as a literal block (config.json stays readable); False when unsafe."""
    if "\n" not in s or s[0] in " \t\n" or s.endswith("\n\n") or _LITERAL_UNSAFE.search(s):
        return False
    pad = " " * (indent + 2)
    out.append(f"{head} |{'' if s.endswith(chr(10)) else '-'}")
    out.extend(f"{pad}{line}" if line else "" for line in s.removesuffix("\n").split("\n"))
    return True


def _block(v: dict[Any, Any] | list[Any], indent: int, out: list[str]) -> None:
    pad = " " * indent
    if isinstance(v, dict):
        for key, item in v.items():
            if isinstance(item, str) and _literal(item, f"{pad}{_scalar(key)}:", indent, out):
                continue
            if isinstance(item, dict) and item:
                out.append(f"{pad}{_scalar(key)}:")
                _block(item, indent + 2, out)
            elif isinstance(item, list) and item:
                out.append(f"{pad}{_scalar(key)}:")
                _block(item, indent, out)  # an indentless sequence, as kubectl writes it
            else:
                out.append(f"{pad}{_scalar(key)}: {_scalar(item)}")
        return
    for item in v:
        if isinstance(item, str) and _literal(item, f"{pad}-", indent, out):
            continue
        if isinstance(item, dict | list) and item:
            start = len(out)
            _block(item, indent + 2, out)
            out[start] = f"{pad}- {out[start][indent + 2:]}"
        else:
            out.append(f"{pad}- {_scalar(item)}")


def dump_all(objects: list[dict[str, Any]]) -> str:
    """The objects as a YAML stream, one document each."""
    docs = []
    for obj in objects:
        lines: list[str] = []
        if obj:
            _block(obj, 0, lines)
        else:
            lines.append("{}")
        docs.append("\n".join(lines) + "\n")
    return "---\n".join(docs)
