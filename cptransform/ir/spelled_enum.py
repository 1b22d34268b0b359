"""Enums whose members are the strings users spell: options accept either."""
from __future__ import annotations

import enum


class SpelledEnum(str, enum.Enum):
    """An enum of option values whose members equal (and print as) their strings, so
    ``load_balance="zigzag"`` and ``Layout.ZIGZAG`` are the same value and name lists are
    read off the class (:meth:`spellings`), never kept by hand."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def spellings(cls) -> tuple[str, ...]:
        """Every member's string, in declaration order."""
        return tuple(member.value for member in cls)
