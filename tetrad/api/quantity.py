"""Kubernetes resource quantities ("500m", "16Gi", "1e3", "2"), parsed exactly, without the kubernetes client.

Invariant: `parse_quantity` accepts what the API server's resource.Quantity accepts (a signed
decimal number, an optional exponent, and one suffix: a binary Ki..Ei, a decimal n..E, or none)
and returns the exact value as a Decimal; anything else raises ValueError naming the input.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Final

BINARY: Final = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
DECIMAL: Final = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
                  "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
                  "P": Decimal("1e15"), "E": Decimal("1e18")}

_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?))$")


def split_quantity(value: str) -> tuple[Decimal, str]:
    """(number, unit) of a quantity, the unit being its suffix or exponent: '16Gi' -> (16, 'Gi'),
    '1e3' -> (1, 'e3')."""
    match = _QUANTITY.match(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity; write e.g. '500m', '4', '16Gi' or '1e3'")
    number, exponent, suffix = match.groups()
    return Decimal(number), exponent or suffix or ""


def parse_quantity(value: str | int | float) -> Decimal:
    """The exact value of a quantity: '500m' -> 0.5, '1Ki' -> 1024, '1e3' -> 1000; numbers pass through."""
    if isinstance(value, int | float):
        return Decimal(str(value))
    number, unit = split_quantity(value)
    if unit in BINARY:
        return number * BINARY[unit]
    if unit in DECIMAL:
        return number * DECIMAL[unit]
    return number.scaleb(int(unit[1:]))  # an exponent: e3, E-2


def scale_quantity(value: str, factor: int) -> str:
    """factor times a quantity, kept in its own unit ('4' x 4 -> '16', '16Gi' x 4 -> '64Gi',
    '1e3' x 2 -> '2e3')."""
    number, unit = split_quantity(value)
    return f"{_plain(number * factor)}{unit}"


def _plain(d: Decimal) -> str:
    """A Decimal without exponent or trailing zeros: 16.0 -> '16', 0.50 -> '0.5'."""
    text = format(d, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text
