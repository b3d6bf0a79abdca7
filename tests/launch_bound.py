"""What the launch-bound tests share: the Python calls a loop makes per step, and the loop
written by hand with ``torch.autocast`` that mixprec's steps are held against (machine- and
load-independent counts, where times are neither)."""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def tiny_mlp() -> nn.Sequential:
    """Linear(32, 32) -> ReLU -> Linear(32, 10): a step of it is its Python and dispatch."""
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def calls_per_step(loop: Callable[[int], None], short: int, long: int) -> float:
    """Python function calls (cProfile's count, built-ins included) per step of
    ``loop(steps)``: the difference of a ``long`` and a ``short`` run, so setup cancels."""

    def calls(steps: int) -> int:
        prof = cProfile.Profile()
        prof.enable()
        loop(steps)
        prof.disable()
        return sum(entry[1] for entry in pstats.Stats(prof).stats.values())  # type: ignore[attr-defined]

    return (calls(long) - calls(short)) / (long - short)


def autocast_loop(
    x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None = torch.bfloat16
) -> Callable[[int], None]:
    """``steps`` autocast SGD steps of a fresh `tiny_mlp` on (x, y) in ``dtype`` (None:
    float32, the autocast context switched off), as written by hand."""

    def loop(steps: int) -> None:
        model = tiny_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(steps):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return loop
