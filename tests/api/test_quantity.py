"""The core's Kubernetes quantity parser: exact values, suffixes kept when scaling, clear errors."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.utils.quantity import parse_quantity as client_parse_quantity

from tetrad.api.quantity import BINARY, DECIMAL, parse_quantity, scale_quantity


@pytest.mark.parametrize("text, value", [
    ("500m", Decimal("0.5")), ("4", Decimal(4)), ("16Gi", Decimal(16 * 2**30)), ("1e3", Decimal(1000)),
    ("1E", Decimal(10**18)), ("1.5Ki", Decimal(1536)), (".5", Decimal("0.5")), ("+2", Decimal(2)),
    ("100M", Decimal(10**8)), ("3n", Decimal("3e-9")), ("2E-3", Decimal("0.002")),
])
def test_parse(text, value):
    assert parse_quantity(text) == value


def test_numbers_pass_through():
    assert parse_quantity(4) == 4 and parse_quantity(0.5) == Decimal("0.5")


@pytest.mark.parametrize("text", ["", "x", "1Gb", "1.2.3", "Gi", "1 Gi", "16gi", "1e"])
def test_rejects_what_is_not_a_quantity(text):
    with pytest.raises(ValueError, match="is not a Kubernetes quantity; write e.g."):
        parse_quantity(text)


@given(st.decimals(min_value=0, max_value=10**6, places=3, allow_nan=False, allow_infinity=False),
       st.sampled_from([*BINARY, *DECIMAL]))
def test_agrees_with_the_kubernetes_client(number, suffix):
    text = f"{number}{suffix}"
    assert parse_quantity(text) == client_parse_quantity(text)


@pytest.mark.parametrize("text, factor, scaled", [
    ("4", 4, "16"), ("16Gi", 4, "64Gi"), ("500m", 2, "1000m"), ("0.5", 2, "1"), ("0.1", 3, "0.3"),
    ("1e3", 2, "2e3"),
])
def test_scale_keeps_the_unit(text, factor, scaled):
    assert scale_quantity(text, factor) == scaled
    assert parse_quantity(scaled) == parse_quantity(text) * factor
