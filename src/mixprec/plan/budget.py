"""`Budget`: what a format search may spend, as fractions of the baseline's bytes and step
time, or as bytes (``memory_bytes``, the whole model's count); `BudgetError` when no plan fits
it; `parse_bytes` reads a size (``"4GiB"``, ``"512MB"``, ``"1000000B"``)."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = [
    "Budget",
    "BudgetError",
    "parse_bytes",
]

BUDGET_KINDS = ("memory", "speed")
# the units a size is written in: powers of 1000 and of 1024, a bare prefix binary (as
# `mixprec bench --memory-limit` reads them: a bare M is a MiB in both)
SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]+)\s*")


def parse_bytes(text: str) -> int:
    """A size written with its unit (``"4GiB"``, ``"1.5GB"``, ``"512MiB"``, ``"100000B"``) in
    bytes; a `ValueError` naming the accepted units otherwise. A bare number is refused: it
    reads as a fraction where budgets take both."""
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    units = {u.lower(): n for u, n in SIZE_UNITS.items()}
    if match is None or match.group(2).lower() not in units:
        raise ValueError(
            f"not a size: {text!r}; write a number and a unit, one of "
            f"{', '.join(SIZE_UNITS)} (e.g. 4GiB, 512MB, 100000B)"
        )
    # (exact decimal arithmetic: a float's 4.1 * 10**6 is 4099999.99..., a byte short)
    value = int(Fraction(match.group(1)) * units[match.group(2).lower()])
    if value <= 0:
        raise ValueError(f"a size must be at least one byte, got {text!r}")
    return value


class BudgetError(ValueError):
    """No plan fits the budget; the message names the smallest one reachable."""


@dataclass(frozen=True)
class Budget:
    """Fractions of the baseline's cost: ``memory`` of its bytes (as ``count`` counts them),
    ``speed`` of its time, both summed over the searched layers. One or both. Or bytes:
    ``memory_bytes``, the whole model's count (every parameter as ``count`` counts it, and
    under ``batch_size`` every saved activation), in place of ``memory``."""

    memory: float | None = None
    speed: float | None = None
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.memory_bytes is not None:
            value = self.memory_bytes
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(
                    f"budget memory_bytes must be a positive whole number of bytes, got {value!r}"
                )
            object.__setattr__(self, "memory_bytes", int(value))
            if self.memory is not None:
                raise ValueError(
                    "a budget takes memory as a fraction (memory=0.5) or in bytes "
                    "(memory_bytes=..., 'memory=2GiB'), not both"
                )
        for kind in BUDGET_KINDS:
            value = getattr(self, kind)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"budget {kind} must be a number, got {value!r}")
            value = float(value)  # numpy's and other real numbers too, as one type
            object.__setattr__(self, kind, value)
            if not 0 < value < math.inf:
                raise ValueError(
                    f"budget {kind} must be a positive fraction of the baseline's "
                    f"{'bytes' if kind == 'memory' else 'time'} (e.g. 0.5), got {value!r}"
                )
        if self.memory is None and self.speed is None and self.memory_bytes is None:
            raise ValueError(
                "a budget needs memory=..., speed=... or both (e.g. memory=0.5, or memory=2GiB)"
            )

    @property
    def kinds(self) -> list[str]:
        return [k for k in BUDGET_KINDS if self.limit(k) is not None]

    def limit(self, kind: str) -> float | None:
        """The budget of `kind`: a fraction, or for memory given in bytes, the bytes."""
        if kind == "memory" and self.memory_bytes is not None:
            return float(self.memory_bytes)
        return getattr(self, kind)

    def describe(self) -> str:
        return ", ".join(
            f"memory <= {self.memory_bytes} bytes"
            if k == "memory" and self.memory_bytes is not None
            else f"{k} <= {getattr(self, k):g}x the baseline"
            for k in self.kinds
        )

    @classmethod
    def of(cls, value: Any) -> Budget:
        """A Budget from a Budget, a mapping (``{"memory": 0.5}``, ``{"memory_bytes": 10**9}``)
        or a string (``"memory=0.5"``, ``"memory=0.5,speed=1"``; ``"memory=2GiB"``: a size
        with its unit, `parse_bytes`, is memory in bytes)."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, str):
            items: dict[str, Any] = {}
            for part in filter(None, (p.strip() for p in value.split(","))):
                key, sep, number = part.partition("=")
                if not sep:
                    raise ValueError(
                        f"budget {key.strip()!r} has no value in {value!r}: write it as "
                        f"{key.strip()}=<value> (e.g. memory=0.5, memory=2GiB, speed=0.8)"
                    )
                # (a size is kept as memory_bytes: "memory=1GiB,memory=2GiB" is twice too)
                if key.strip() in items or (key.strip() == "memory" and "memory_bytes" in items):
                    raise ValueError(f"budget {key.strip()!r} given twice in {value!r}")
                try:
                    items[key.strip()] = float(number)
                except ValueError:
                    if key.strip() == "memory" and re.search(r"\d\s*[A-Za-z]+\s*$", number):
                        items["memory_bytes"] = parse_bytes(number)
                        continue
                    items[key.strip()] = number
            value = items
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {*BUDGET_KINDS, "memory_bytes"})
            if unknown:
                raise ValueError(
                    f"unknown budget {', '.join(map(repr, unknown))}: a budget takes memory "
                    "and/or speed, fractions of the baseline's, e.g. {'memory': 0.5}, or "
                    "memory_bytes (bytes, e.g. 'memory=2GiB')"
                )
            return cls(**value)
        raise TypeError(
            "budget must be a Budget, a dict such as {'memory': 0.5} or a string such as "
            f"'memory=0.5'; got {type(value).__name__}"
        )
