"""The code shape limits of tests/check_sizes.py hold: short functions, small gateway modules."""

from __future__ import annotations

from tests.check_sizes import violations


def test_no_function_over_80_lines_and_no_gateway_module_over_400() -> None:
    assert violations() == []
