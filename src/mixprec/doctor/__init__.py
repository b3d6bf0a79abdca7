"""The numerics doctor: find the layers that break in low precision and the policy that fixes
them (`diagnose`, `Diagnosis.recommend`), watch them during training (`PrecisionMonitor`),
and name the layers whose optimizer states a low-bit format hurts (`state_errors`).

- `probe`: hooks on every module of a run and its gradients; per-tensor statistics against
  the float32 reference twin (range, overflow, underflow, flush to zero, inf/NaN, error).
- `running`: one probed run of a fresh copy of the model in a precision (same batch and
  seed each time; the loss by `step.batch_loss`).
- `verdicts`: the vocabulary and thresholds the rules read; `rules`: small named rules tried
  in a documented order, the first finding winning; `diagnosis`: `diagnose` and `recommend`.
- `report`: tables, markdown, plots and report files; `monitor`: live per-layer amax and
  underflow during training, through the Trainer hooks it defines (no Trainer import).
- `state_errors`: the update error `m / (sqrt(v) + eps)` of each layer's moments stored in
  a state format and read back, and the `states` rule keeping the bad ones float32.
"""

from mixprec.doctor.diagnosis import Diagnosis, Recommendation, diagnose
from mixprec.doctor.monitor import LayerSample, PrecisionMonitor, PrecisionWarning
from mixprec.doctor.state_errors import StateError, StateErrors, moment_errors, state_errors
from mixprec.doctor.verdicts import (
    AT_RISK,
    BROKEN,
    OK,
    FindingKind,
    ModuleReport,
    ParamReport,
    Verdict,
)

__all__ = [
    "AT_RISK",
    "BROKEN",
    "OK",
    "Diagnosis",
    "FindingKind",
    "LayerSample",
    "ModuleReport",
    "ParamReport",
    "PrecisionMonitor",
    "PrecisionWarning",
    "Recommendation",
    "StateError",
    "StateErrors",
    "Verdict",
    "diagnose",
    "moment_errors",
    "state_errors",
]
