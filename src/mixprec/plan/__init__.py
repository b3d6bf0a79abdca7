"""Per-layer format search: `search` chooses a format for each layer within a memory or speed
budget, scored by each format's damage to the loss, solved by dynamic programming (exact for
bytes with a common divisor, `solver`), verified by running the plan; the `SearchReport`
holds the plan as a policy (``report.policy``; ``save`` writes it as the doctor's
``policy.json``).

Modules: `units` (the layers searched, the formats, bytes), `sensitivity` (damage and time
of each layer in each format), `solver` (the budgeted assignment), `measure` (plans run:
loss, bytes, time, a training run), `report`, `searching` (`search` itself).
"""

from __future__ import annotations

from mixprec.plan.report import SearchReport
from mixprec.plan.searching import Budget, BudgetError, search

__all__ = ["Budget", "BudgetError", "SearchReport", "search"]
