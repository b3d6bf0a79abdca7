"""Backward passes with no second derivative, that say so when differentiated again.

The float8 and block-scaled layers compute their gradients on quantized copies detached from
the weight and the input, so a gradient of those gradients (a gradient penalty, a
meta-learning step: anything built on ``create_graph=True``) would lack every term through
them. torch's ``once_differentiable`` raises only when the gradient arriving at the backward
itself needs a graph; a penalty on an input gradient that starts from ``out.sum()`` arrives
without one, and its terms through the weight went missing without a word. `first_order`
hangs the gradients it returns off a node fed by the weight and the incoming gradient, which
raises whenever anything differentiates through it; first-order gradients taken with
``create_graph=True`` are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []

Gradients = tuple[Tensor | None, ...]


def first_order(layer: str, compute: Callable[[], Gradients], *feeds: Tensor) -> Gradients:
    """The gradients `compute` returns (a backward's math, run without a graph). When the
    backward runs with ``create_graph=True`` and any of `feeds` (the weight, the incoming
    gradient) needs a gradient, they come out of a node that raises, naming `layer`, when a
    second backward reaches it."""
    graph = torch.is_grad_enabled() and not torch.compiler.is_compiling()
    if not (graph and any(t.requires_grad for t in feeds)):
        with torch.no_grad():
            return compute()
    return _NoSecondDerivative.apply(layer, compute, *feeds)


class _NoSecondDerivative(torch.autograd.Function):
    """Runs the backward's math as its forward; its own backward is the refusal."""

    @staticmethod
    def forward(ctx: Any, layer: str, compute: Callable[[], Gradients], *feeds: Tensor) -> Any:
        ctx.layer = layer
        return compute()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, ...]:
        raise RuntimeError(
            f"{ctx.layer} has no second derivative: its backward works on quantized copies "
            f"detached from the weight, so a gradient taken with create_graph=True through it "
            f"(a gradient penalty, a meta-learning step) cannot be differentiated twice. Keep "
            f"this layer float (a quantize filter, a float rule for its path) or take the "
            f"penalty's gradient through float layers only."
        )
