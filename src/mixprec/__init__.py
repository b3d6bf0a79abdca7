"""mixprec: mixed-precision training for PyTorch.

Precision policies per layer, loss scaling, a Trainer with a precision flag, the
float32-vs-mixed benchmark, and a numerics doctor: one path for data, many front doors.
"""

from mixprec.convert import applied_policy, apply, cast_floating, remove
from mixprec.doctor import Diagnosis, PrecisionMonitor, diagnose
from mixprec.dtypes import FormatInfo, format_info
from mixprec.errors import PolicySpecError, PrecisionError, SlowPrecisionError
from mixprec.hardware import (
    DeviceInfo,
    Support,
    detect,
    resolve_auto,
    resolve_policy,
    support_matrix,
)
from mixprec.optim import LossScaleOptimizer, joint_step, scheduler_step
from mixprec.policy import (
    POLICY_NAMES,
    Policy,
    as_policy,
    global_policy,
    policy_scope,
    set_global_policy,
)
from mixprec.policy_map import PolicyMap, explain
from mixprec.precision import Precision
from mixprec.scaling import (
    DynamicLossScaler,
    LossScaleDivergedError,
    LossScaler,
    LossScalerStats,
    NoLossScaler,
    StaticLossScaler,
)
from mixprec.trainer import (
    Callback,
    CSVLogger,
    EarlyStopping,
    Logger,
    ModelCheckpoint,
    RichProgressBar,
    TensorBoardLogger,
    Trainer,
    TrainingModule,
    seed_everything,
)

__version__ = "0.1.0"

__all__ = [
    "POLICY_NAMES",
    "CSVLogger",
    "Callback",
    "DeviceInfo",
    "Diagnosis",
    "DynamicLossScaler",
    "EarlyStopping",
    "FormatInfo",
    "Logger",
    "LossScaleDivergedError",
    "LossScaleOptimizer",
    "LossScaler",
    "LossScalerStats",
    "ModelCheckpoint",
    "NoLossScaler",
    "Policy",
    "PolicyMap",
    "PolicySpecError",
    "Precision",
    "PrecisionError",
    "PrecisionMonitor",
    "RichProgressBar",
    "SlowPrecisionError",
    "StaticLossScaler",
    "Support",
    "TensorBoardLogger",
    "Trainer",
    "TrainingModule",
    "__version__",
    "applied_policy",
    "apply",
    "as_policy",
    "cast_floating",
    "detect",
    "diagnose",
    "explain",
    "format_info",
    "global_policy",
    "joint_step",
    "policy_scope",
    "remove",
    "resolve_auto",
    "resolve_policy",
    "scheduler_step",
    "seed_everything",
    "set_global_policy",
    "support_matrix",
]
