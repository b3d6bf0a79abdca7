"""Tiny models the tests share, each built from a seed so that a test asserting exact numbers
gets the same weights wherever it builds one."""

from __future__ import annotations

import torch
from torch import nn


def mlp(
    inputs: int = 4,
    hidden: int = 8,
    outputs: int = 2,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> nn.Sequential:
    """Linear(inputs, hidden) -> tanh -> Linear(hidden, outputs) in `dtype`, its weights drawn
    right after `torch.manual_seed(seed)` (which reseeds the global generator too)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, outputs)).to(dtype)
