"""Plain YAML scalars read the way kubectl reads them, so a manifest means the same to Tetrad as to the API
server.

kubectl turns YAML into JSON with go-yaml v2's resolver (sigs.k8s.io/yaml), and the API server reads
that JSON; PyYAML follows YAML 1.1 to the letter and reads some of the same text otherwise:

    text           kubectl (what the API server gets)     PyYAML
    3e-4, 1e5      0.0003, 100000 (an exponent needs no dot) '3e-4', '1e5'
    +.5, 1.0e5     0.5, 100000                             '+.5', '1.0e5'
    08, 09.5       8, 9.5                                  '08', '09.5'
    0o17           15                                      '0o17'
    1:30           '1:30'                                  90 (base 60)
    y, n, Y, N     true, false                             'y', 'n', 'Y', 'N'
    2.0            2 (JSON has one kind of number)         2.0
    1: a (a key)   "1": a (JSON keys are strings)          1: a

`go_scalar` is go-yaml's resolution of an unquoted scalar (a number that does not fit a float64 stays
text); `plain_scalar` adds the API server's reading of the JSON number kubectl writes: a whole number
within int64 is an integer, any other number a float. `mapping_key` is sigs.k8s.io/yaml's conversion
of a key, as go-yaml resolved it, to JSON. tests/api/test_kubectl_reader.py compares both with kubectl itself.
Standard library only.
"""

from __future__ import annotations

import math
import re
import struct
from decimal import Decimal
from typing import Final

INT64: Final = range(-(2**63), 2**63)
UINT64_MAX: Final = 2**64 - 1
# go-yaml's lookup table of plain scalars (resolve.go); the booleans include YAML 1.1's y and n.
BOOLEANS: Final = {**dict.fromkeys(("y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE",
                                    "on", "On", "ON"), True),
                   **dict.fromkeys(("n", "N", "no", "No", "NO", "false", "False", "FALSE",
                                    "off", "Off", "OFF"), False)}
SPECIAL_FLOATS: Final = {**dict.fromkeys((".nan", ".NaN", ".NAN"), math.nan),
                         **dict.fromkeys((".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF"), math.inf),
                         **dict.fromkeys(("-.inf", "-.Inf", "-.INF"), -math.inf)}
# The first characters go-yaml tries as numbers: a sign, a digit, a dot.
NUMBER_START: Final = "+-0123456789."
# strconv.ParseInt(s, 0, 64) after go-yaml drops every underscore: Go's prefixes, a leading 0 for octal.
_GO_INT = re.compile(r"([-+]?)(?:0[xX]([0-9a-fA-F]+)|0[oO]([0-7]+)|0[bB]([01]+)|(0[0-7]*)|([1-9][0-9]*))")
# go-yaml's yamlStyleFloat: an exponent needs no dot, a dot needs no digit after it.
_GO_FLOAT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?")
# strconv.ParseFloat of a scalar that starts with a dot (underscores only between digits).
_DOT_FLOAT = re.compile(r"\.[0-9](?:_?[0-9])*(?:[eE][-+]?[0-9](?:_?[0-9])*)?")


def go_scalar(text: str) -> bool | int | float | str | None:
    """An unquoted scalar as go-yaml v2 resolves it: None, a boolean, an integer (int64 or uint64), a float
    or the text."""
    if text in ("", "~", "null", "Null", "NULL"):
        return None
    if text in BOOLEANS:
        return BOOLEANS[text]
    if text in SPECIAL_FLOATS:
        return SPECIAL_FLOATS[text]
    if text[0] not in NUMBER_START:
        return text
    if text[0] == ".":
        return float(text.replace("_", "")) if _DOT_FLOAT.fullmatch(text) else text
    plain = text.replace("_", "")
    if (m := _GO_INT.fullmatch(plain)) is not None:
        sign, hexa, octal, binary, leading_zero, decimal = m.groups()
        if leading_zero is not None:
            value = int(leading_zero[1:] or "0", 8)
        else:
            value = next(int(d, base) for d, base in ((hexa, 16), (octal, 8), (binary, 2), (decimal, 10))
                         if d is not None)
        value = -value if sign == "-" else value
        if value in INT64 or (not sign and value <= UINT64_MAX):  # strconv.ParseInt, then ParseUint (no sign)
            return value
    if _GO_FLOAT.fullmatch(plain) and not math.isinf(number := float(plain)):
        return number
    return text


def plain_scalar(text: str) -> bool | int | float | str | None:
    """An unquoted scalar's value as the API server gets it from kubectl: a number as JSON carries it."""
    value = go_scalar(text)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if isinstance(value, int):
        # the API server reads a JSON integer beyond int64 as a float
        return value if value in INT64 else float(value)
    return _json_number(value)


def _json_number(value: float) -> int | float:
    """A float as the API server reads the JSON kubectl writes for it: Go writes a whole number below
    1e21 without a fraction (its shortest digits), which reads back as an integer when it fits int64."""
    if value.is_integer():
        whole = int(Decimal(repr(value)))
        if whole in INT64:
            return whole
    return value


def mapping_key(key: object) -> object:
    """A mapping key, as go-yaml resolved it, as JSON has it (sigs.k8s.io/yaml): a boolean or a number
    becomes its text; others stay."""
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, int):
        return str(key)
    if isinstance(key, float):
        return _float32_text(key)
    return key


def _float32_text(value: float) -> str:
    """strconv.FormatFloat(value, 'g', -1, 32) in go-yaml's spelling of the specials."""
    if math.isnan(value):
        return ".nan"
    try:
        single = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        single = math.copysign(math.inf, value)
    if math.isinf(single):
        return ".inf" if single > 0 else "-.inf"
    if single == 0:
        return "-0" if math.copysign(1, single) < 0 else "0"
    for precision in range(1, 10):  # the shortest digits that read back as the same float32
        mantissa, exponent = f"{single:.{precision - 1}e}".split("e")
        if struct.unpack("f", struct.pack("f", float(f"{mantissa}e{exponent}")))[0] == single:
            break
    sign, mantissa = ("-", mantissa[1:]) if mantissa.startswith("-") else ("", mantissa)
    digits, exp = mantissa.replace(".", ""), int(exponent)
    if exp < -4 or exp >= 6:  # 'g' with the shortest digits switches to an exponent from 1e-5 and 1e6 on
        head = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{sign}{head}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    if exp < 0:
        return f"{sign}0.{'0' * (-exp - 1)}{digits}"
    whole, fraction = digits[: exp + 1].ljust(exp + 1, "0"), digits[exp + 1:]
    return f"{sign}{whole}" + (f".{fraction}" if fraction else "")
