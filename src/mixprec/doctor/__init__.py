"""The numerics doctor: find the layers that break in low precision and the policy that fixes
them (`diagnose`, `Diagnosis.recommend`), watch them during training (`PrecisionMonitor`),
and name the layers whose optimizer states a low-bit format hurts (`state_errors`)."""

from mixprec.doctor.diagnosis import Diagnosis, Recommendation, diagnose
from mixprec.doctor.monitor import LayerSample, PrecisionMonitor, PrecisionWarning
from mixprec.doctor.state_errors import StateError, StateErrors, state_errors
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
    "state_errors",
]
