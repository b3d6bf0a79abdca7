"""Compensated optimizer steps for 16-bit parameters kept without float32 master weights.

A bfloat16 weight has 8 significant bits: an update below half the spacing of bfloat16
numbers at the weight rounds away, so plain ``bf16-true`` training stalls once updates get
small. Two fixes keep the memory of pure 16-bit training (no float32 copy of the weights):

- ``"kahan"``: each parameter gets a 16-bit buffer holding what the last rounding lost,
  added back into the next update (Kahan summation);
- ``"stochastic"``: the float32 result is rounded up or down at random, with probability
  proportional to the distance, so updates survive on average; no buffer.

``Compensator(kind).step(optimizer)`` replaces ``optimizer.step()`` for torch's AdamW, Adam
and SGD, from the optimizer's own groups and state (so schedulers and checkpoints keep
working). Modules: `rules` (what is compensated and what is refused), `kernels` (the
elementwise Adam and SGD math, the compiled kernels), `compensator` (`Compensator`). The
weight's write-back, the random bits, the compile gate and the optimizers stood in for are
the engine's (`mixprec.optim.engine`), which the low-bit optimizers share.
How it works and what it costs, measured: docs/pure-bf16.md.
"""

from __future__ import annotations

from mixprec.optim.compensated.compensator import COMPILE_MIN_ELEMENTS, SMALL, Compensator
from mixprec.optim.engine import (
    COMPENSATED_DTYPES,
    COMPENSATIONS,
    check_compensation,
    stochastic_round_,
)

__all__ = [
    "COMPENSATED_DTYPES",
    "COMPENSATIONS",
    "COMPILE_MIN_ELEMENTS",
    "SMALL",
    "Compensator",
    "check_compensation",
    "stochastic_round_",
]
