"""Integers off a wire, strictly. Python's ``int(text)`` accepts ``"²"`` and other Unicode
digits, underscores (``"1_000"``), signs and surrounding whitespace, and raises
``ValueError`` past 4,300 digits; ``parse_count`` accepts exactly ``[0-9]{1,MAX_DIGITS}``.
JSON numbers are decoded by msgspec into Python ints of any size; ``check_int_range`` bounds
them before numpy or an index sees them, and ``finite_number`` takes a JSON number as a
finite float."""

from __future__ import annotations

import math
from typing import Any

from service.errors import InvalidInput

MAX_DIGITS = 18  # every value up to 10**18 - 1 fits a signed 64-bit integer
ASCII_DIGITS = frozenset("0123456789")


def parse_count(text: str | bytes | None, what: str, *, minimum: int = 0) -> int:
    """``text`` as a non-negative decimal integer of 1 to MAX_DIGITS ASCII digits.

    ``what`` names the input in the message (``"query parameter k"``). InvalidInput when the
    text is empty, has any character other than 0-9 (signs, spaces, Unicode digits,
    underscores), more than MAX_DIGITS digits, or a value below ``minimum``.
    """
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    if text is None or not text or len(text) > MAX_DIGITS or not ASCII_DIGITS.issuperset(text):
        shown = _shown(text)
        raise InvalidInput(
            f"{what} must be an integer >= {minimum} written with 1 to {MAX_DIGITS} ASCII "
            f"digits, got {shown}"
        )
    value = int(text)
    if value < minimum:
        raise InvalidInput(f"{what} must be an integer >= {minimum}, got {value}")
    return value


def check_int_range(value: Any, what: str, *, minimum: int, maximum: int | None = None) -> int:
    """A JSON integer (not a bool, not a float) within [minimum, maximum]; any size of int
    is compared exactly, so 10**30 is refused by its value, not by an overflow."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{what} must be an integer >= {minimum}, got {_shown(value)}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise InvalidInput(f"{what} must be an integer {bound}, got {_shown(value)}")
    return value


def finite_number(value: Any, what: str) -> float:
    """A JSON number (int of any size or float, not a bool) as a finite float; InvalidInput
    for anything else, including ints too large for a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"{what} must be a number, got {_shown(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise InvalidInput(f"{what} must be a finite number, got {_shown(value)}") from None
    if not math.isfinite(number):
        raise InvalidInput(f"{what} must be a finite number, got {_shown(value)}")
    return number


def _shown(value: Any, limit: int = 40) -> str:
    """``repr(value)``, shortened for a message (a 5,000-digit number is not echoed)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"{'-' if value < 0 else ''}an integer of about {digits} digits"
    text = repr(value)
    if len(text) > limit:
        return f"{text[: limit - 10]}... ({len(text)} characters)"
    return text
