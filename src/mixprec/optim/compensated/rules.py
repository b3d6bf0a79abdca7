"""Which optimizers and parameters a compensated step covers: the compensations
(`COMPENSATIONS`), the 16-bit dtypes compensated (`COMPENSATED_DTYPES`) and the torch
optimizers it stands in for (the engine's, `mixprec.optim.engine`, which the low-bit
optimizers share), and the flags it refuses, each refusal naming what to do instead."""

from __future__ import annotations

import inspect

import torch

from mixprec.optim.engine import (
    SUPPORTED_OPTIMIZERS,
)

__all__ = []

# torch's AdamW, Adam and SGD (`mixprec.optim.engine.SUPPORTED_OPTIMIZERS`): the classes a
# compensated step stands in for, and subclasses keeping their step
SUPPORTED = tuple(SUPPORTED_OPTIMIZERS)
# the steps the compensated step stands in for (unwrapped from torch's hook wrapper): a
# subclass that overrides ``step`` is refused
_TORCH_STEPS = tuple({inspect.unwrap(cls.step) for cls in SUPPORTED_OPTIMIZERS})
# optimizer flags the compensated step cannot honour: (flag, why, what to do instead)
_REFUSED_FLAGS = (
    (
        "amsgrad",
        "the step keeps no maximum of the second moment",
        "use master_weights=True: torch's own AMSGrad step on float32 masters",
    ),
    (
        "capturable",
        "the step reads each parameter's step count on the host, which a CUDA graph cannot capture",
        "use master_weights=True: torch's own step on float32 masters",
    ),
    (
        "differentiable",
        "the step runs under no_grad and writes its 16-bit results in place, so no "
        "gradient flows through it",
        "use master_weights=True: torch's own step on float32 masters",
    ),
)


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``optimizer`` can be compensated: a torch
    AdamW, Adam or SGD (or a subclass keeping torch's ``step``) without ``amsgrad``,
    ``capturable`` or ``differentiable`` in any group. ``foreach`` and ``fused`` pick
    torch's implementation of the same math, which the compensated kernel replaces."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, SUPPORTED):
        raise TypeError(
            f"compensated updates support torch.optim.AdamW, Adam and SGD, got "
            f"{name}; use master_weights=True for other optimizers"
        )
    if inspect.unwrap(type(optimizer).step) not in _TORCH_STEPS:
        raise TypeError(
            f"{type(optimizer).__qualname__} overrides step(): a compensated step runs "
            f"torch's {'SGD' if isinstance(optimizer, torch.optim.SGD) else 'Adam'} "
            f"algorithm in its place, so the override would never run. Use "
            f"master_weights=True (the optimizer's own step on float32 masters), or "
            f"compensate torch.optim.AdamW, Adam or SGD itself"
        )
    for group in optimizer.param_groups:
        for flag, why, instead in _REFUSED_FLAGS:
            if group.get(flag):
                raise ValueError(
                    f"compensated updates do not support {name}({flag}=True): {why}. "
                    f"Build the optimizer with {flag}=False, or {instead}"
                )
