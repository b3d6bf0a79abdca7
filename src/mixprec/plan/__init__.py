"""Per-layer format search: `search` chooses a format for each layer within a memory or speed
budget, scored by each format's damage to the loss, solved by dynamic programming (exact for
bytes with a common divisor, `solver`), verified by running the plan; the `SearchReport`
holds the plan as a policy (``report.policy``; ``save`` writes it as the doctor's
``policy.json``).

Modules: `budget` (`Budget`), `units` (the layers searched, the formats, bytes),
`sensitivity` (damage and time of each layer in each format), `solver` (the budgeted
assignment), `measure` (plans run: loss, bytes, time, a training run), `report`, `inputs`
(the arguments checked), `scoring` (candidates built, scored, timed), `verify` (solve, verify,
retry, keep), `searching` (`search` itself, the phases in order), `activation_choice` (each
block's activation option under ``batch_size``), `fitting` (`fit`: the plan whose measured
training step fits a budget in bytes).
"""

from __future__ import annotations

from mixprec.plan.budget import Budget, BudgetError
from mixprec.plan.fitting import FitReport, fit
from mixprec.plan.report import SearchReport
from mixprec.plan.searching import search

__all__ = ["Budget", "BudgetError", "FitReport", "SearchReport", "fit", "search"]
