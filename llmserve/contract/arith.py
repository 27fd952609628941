"""Integer helpers every service shares."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints (b > 0): e.g. the blocks that hold a tokens."""
    return -(-a // b)
