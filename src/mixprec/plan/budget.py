"""`Budget`: what a format search may spend, as fractions of the baseline's bytes and step
time; `BudgetError` when no plan fits it."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["BUDGET_KINDS", "Budget", "BudgetError"]

BUDGET_KINDS = ("memory", "speed")


class BudgetError(ValueError):
    """No plan fits the budget; the message names the smallest one reachable."""


@dataclass(frozen=True)
class Budget:
    """Fractions of the baseline's cost: ``memory`` of its bytes (as ``count`` counts them),
    ``speed`` of its time, both summed over the searched layers. One or both."""

    memory: float | None = None
    speed: float | None = None

    def __post_init__(self) -> None:
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
        if self.memory is None and self.speed is None:
            raise ValueError("a budget needs memory=..., speed=... or both (e.g. memory=0.5)")

    @property
    def kinds(self) -> list[str]:
        return [k for k in BUDGET_KINDS if getattr(self, k) is not None]

    def describe(self) -> str:
        return ", ".join(f"{k} <= {getattr(self, k):g}x the baseline" for k in self.kinds)

    @classmethod
    def of(cls, value: Any) -> Budget:
        """A Budget from a Budget, a mapping (``{"memory": 0.5}``) or a string
        (``"memory=0.5"``, ``"memory=0.5,speed=1"``)."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, str):
            items: dict[str, Any] = {}
            for part in filter(None, (p.strip() for p in value.split(","))):
                key, sep, number = part.partition("=")
                if key.strip() in items:
                    raise ValueError(f"budget {key.strip()!r} given twice in {value!r}")
                try:
                    items[key.strip()] = float(number) if sep else None
                except ValueError:
                    items[key.strip()] = number
            value = items
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(BUDGET_KINDS))
            if unknown:
                raise ValueError(
                    f"unknown budget {', '.join(map(repr, unknown))}: a budget takes memory "
                    "and/or speed, fractions of the baseline's, e.g. {'memory': 0.5}"
                )
            return cls(**value)
        raise TypeError(
            "budget must be a Budget, a dict such as {'memory': 0.5} or a string such as "
            f"'memory=0.5'; got {type(value).__name__}"
        )
