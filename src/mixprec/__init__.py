"""mixprec: mixed-precision training for PyTorch.

Precision policies per layer, loss scaling, a Trainer with a precision flag, the
float32-vs-mixed benchmark, and a numerics doctor: one path for data, many front doors.
"""

from mixprec.convert import applied_policy, apply, cast_floating, remove
from mixprec.dtypes import FormatInfo, format_info
from mixprec.errors import PolicySpecError, PrecisionError, SlowPrecisionError
from mixprec.hardware import DeviceInfo, Support, detect, resolve_auto, support_matrix
from mixprec.policy import (
    POLICY_NAMES,
    Policy,
    as_policy,
    global_policy,
    policy_scope,
    set_global_policy,
)
from mixprec.policy_map import PolicyMap, explain

__version__ = "0.1.0"

__all__ = [
    "POLICY_NAMES",
    "DeviceInfo",
    "FormatInfo",
    "Policy",
    "PolicyMap",
    "PolicySpecError",
    "PrecisionError",
    "SlowPrecisionError",
    "Support",
    "__version__",
    "applied_policy",
    "apply",
    "as_policy",
    "cast_floating",
    "detect",
    "explain",
    "format_info",
    "global_policy",
    "policy_scope",
    "remove",
    "resolve_auto",
    "set_global_policy",
    "support_matrix",
]
