"""The optimizer side of mixprec, in one room: what wraps, scales, compensates and stores an
optimizer's step.

- `wrapper`: ``LossScaleOptimizer`` (loss scaling and float32 master weights around any
  torch optimizer), ``joint_step``, ``scheduler_step``, ``backward_context``...
- `checkpoint`: the wrapper's saving and loading; `masters`: the float32 master weights.
- `scaling`: the loss scalers (``DynamicLossScaler``, ``StaticLossScaler``...).
- `compensated`: Kahan and stochastic rounding of 16-bit weights for torch's AdamW, Adam
  and SGD (``Compensator``), and the step engine the low-bit optimizers share with it
  (`compensated.engine`: the weight write-back, the random bits, the compile gate, the
  supported optimizers).
- `states`: the optimizer-state formats (one registered codec per kind) and the low-bit
  optimizers (``LowBitAdamW``, ``AdamW8bit``...).
- `conversion`: ``convert_for``, the optimizer a policy map's state formats make of a
  torch optimizer (what ``Precision.setup`` asks for), and ``warn_if_foreign``, its warning
  about an optimizer holding none of the model's parameters.

Names load on first use: ``from mixprec.optim import LossScaleOptimizer`` imports the
wrapper then, and ``import mixprec.optim.states`` (as the policy map does, layers below the
wrapper) imports the states alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.optim.conversion import convert_for, warn_if_foreign
    from mixprec.optim.wrapper import (
        LossScaleOptimizer,
        OptState,
        SkipAwareScheduler,
        backward_context,
        backward_dtype,
        check_sharded_masters,
        follow_steps,
        joint_step,
        master_weights_by_name,
        scale_for_backward,
        scheduler_step,
    )

__all__ = [
    "LossScaleOptimizer",
    "OptState",
    "SkipAwareScheduler",
    "backward_context",
    "backward_dtype",
    "check_sharded_masters",
    "convert_for",
    "follow_steps",
    "joint_step",
    "master_weights_by_name",
    "scale_for_backward",
    "scheduler_step",
    "warn_if_foreign",
]

# each public name -> the submodule defining it
_HOME = {name: "wrapper" for name in __all__} | dict.fromkeys(
    ("convert_for", "warn_if_foreign"), "conversion"
)
_SUBMODULES = ("checkpoint", "compensated", "conversion", "masters", "scaling", "states", "wrapper")


def __getattr__(name: str) -> Any:
    """A public name, or a submodule, imported on first use (then kept here)."""
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})
