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


class Overflow(nn.Module):
    """`proj` outputs up to 1e5 (> float16 max 65504); the LayerNorm after it makes that
    harmless in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(self.act(self.inp(x)))))


def overflow_model(peak: float = 1e5) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = Overflow()
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    with torch.no_grad():
        amax = model.proj(model.act(model.inp(x))).abs().max()
        model.proj.weight.mul_(peak / amax)
        model.proj.bias.mul_(peak / amax)
    return model, (x, y)


class Residual(nn.Module):
    """x + fc(norm(x)), or x + tanh(fc(norm(x))): a block whose LayerNorm is a float32 island
    under a mixed policy."""

    def __init__(self, width: int, *, tanh: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.tanh = tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.norm(x))
        return x + (torch.tanh(h) if self.tanh else h)


class BlockNet(nn.Module):
    """Linear(4, width) -> two `Residual` blocks in a ModuleList (FSDP's units) -> Linear(width, 1),
    its weights drawn right after `torch.manual_seed(seed)`."""

    def __init__(self, width: int = 16, *, tanh: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Residual(width, tanh=tanh) for _ in range(2))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
