"""`tetrad convert`: the output of tetrad.convert as the user sees it.

The jobs as a multi-document YAML stream, each headed by comments that name its source and list the
notes; on stderr one line per note. Notes quote user values, so every line they make is kept to one
line: control characters and Unicode line breaks are written as escapes.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from tetrad.cli.yamlout import dump_all
from tetrad.convert import KINDS, Conversion, Note

# What would end a comment or a terminal line early: C0/C1 controls, Unicode line and paragraph separators,
# BOM.
_BREAKING = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ufeff]")
# A block list of integers as dump_all writes it (one `- N` line each), written as a flow list instead.
_INT_LIST = re.compile(r"^( *)([A-Za-z][A-Za-z0-9]*):\n((?:\1- -?\d+\n)+)", re.MULTILINE)


def one_line(text: str) -> str:
    return _BREAKING.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def note_line(conversion: Conversion, note: Note) -> str:
    """A note as stderr shows it: `changed: PyTorchJob ns/name: field: message`."""
    return one_line(f"{note.kind}: {conversion.source}: {note}")


def _flow_int_lists(text: str) -> str:
    def flow(m: re.Match[str]) -> str:
        numbers = re.findall(r"-?\d+", m.group(3))
        return f"{m.group(1)}{m.group(2)}: [{', '.join(numbers)}]\n"

    return _INT_LIST.sub(flow, text)


def header(conversion: Conversion) -> str:
    lines = [f"# Converted by `tetrad convert` from {conversion.source} ({conversion.api_version})."]
    for kind in KINDS:
        notes = [n for n in conversion.notes if n.kind == kind]
        if notes:
            lines.append(f"# {kind}:")
            lines += [f"#   {n}" for n in notes]
    return "".join(one_line(line) + "\n" for line in lines)


def render(conversions: list[Conversion]) -> str:
    """The converted jobs as one YAML stream, a header of comments on each document."""
    return "---\n".join(header(c) + _flow_int_lists(dump_all([c.job])) for c in conversions)


def write_new(path: Path, text: str, *, force: bool) -> None:
    """Write `text` to `path`: a new file, or with `force` over an existing one (atomically, by a rename)."""
    if not force:
        with path.open("x") as f:  # FileExistsError when it exists
            f.write(text)
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent or Path("."), prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
