"""mixprec: mixed-precision training for PyTorch.

Precision policies per layer, loss scaling, a Trainer with a precision flag, the
float32-vs-mixed benchmark, and a numerics doctor: one path for data, many front doors.

The names a user types daily live here; helpers stay in their modules (`mixprec.hardware`,
`mixprec.optim` (with `optim.states`), `mixprec.activations`, `mixprec.dtypes`,
`mixprec.trainer`, `mixprec.doctor`, `mixprec.bench`).
The Trainer and the doctor load on first use, so `import mixprec` stays light (no rich, no
Trainer).
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import TYPE_CHECKING, Any

# the package, which is callable: mixprec.quantize(model, "int8") quantizes in place and
# mixprec.quantize.dequantize / enable_lora / merge_lora are its other functions
import mixprec.quantize as quantize
from mixprec.activations import ActivationRules
from mixprec.convert import apply, explain, remove
from mixprec.errors import (
    PolicySpecError,
    PrecisionError,
    SlowPrecisionError,
    SlowPrecisionWarning,
)
from mixprec.formats import register
from mixprec.optim import LossScaleOptimizer
from mixprec.optim.scaling import (
    DynamicLossScaler,
    LossScaleDivergedError,
    LossScaler,
    NoLossScaler,
    StaticLossScaler,
)
from mixprec.optim.states import AdamW4bit, AdamW8bit, AdamWFp8, LowBitAdamW, LowBitSGD
from mixprec.policy import Policy, global_policy, policy_scope, set_global_policy
from mixprec.policy.map import PolicyMap
from mixprec.precision import Precision
from mixprec.version import __version__

# the builtin formats, registered once, here, in the order names and searches list them
for _builtin in quantize.BUILTIN_FORMATS:
    register(_builtin)

if TYPE_CHECKING:
    from mixprec.doctor import PrecisionMonitor, diagnose
    from mixprec.plan import search
    from mixprec.trainer import Trainer, TrainingModule

_LAZY = {
    "Trainer": "mixprec.trainer",
    "TrainingModule": "mixprec.trainer",
    "diagnose": "mixprec.doctor",
    "PrecisionMonitor": "mixprec.doctor",
    "search": "mixprec.plan",
}

__all__ = [
    "ActivationRules",
    "AdamW4bit",
    "AdamW8bit",
    "AdamWFp8",
    "DynamicLossScaler",
    "LossScaleDivergedError",
    "LossScaleOptimizer",
    "LossScaler",
    "LowBitAdamW",
    "LowBitSGD",
    "NoLossScaler",
    "Policy",
    "PolicyMap",
    "PolicySpecError",
    "Precision",
    "PrecisionError",
    "PrecisionMonitor",
    "SlowPrecisionError",
    "SlowPrecisionWarning",
    "StaticLossScaler",
    "Trainer",
    "TrainingModule",
    "__version__",
    "apply",
    "diagnose",
    "explain",
    "global_policy",
    "policy_scope",
    "quantize",
    "remove",
    "search",
    "set_global_policy",
]


def __getattr__(name: str) -> Any:
    """Load the Trainer, the doctor and the format search on first use."""
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mixprec' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, the submodules loaded so far and the module's dunders: not the
    helpers this file imports for itself (what `dir` and tab completion offer)."""
    here = globals()
    loaded = {n for n, v in here.items() if sys.modules.get(f"{__name__}.{n}") is v}
    dunders = {n for n in here if n.startswith("__") and n.endswith("__")}
    return sorted({*__all__, *loaded, *dunders})
