"""The numerics doctor: find the layers that break in low precision and the policy that fixes
them (`diagnose`, `Diagnosis.recommend`), and watch them during training
(`PrecisionMonitor`)."""

from mixprec.doctor.diagnosis import Diagnosis, Recommendation, diagnose
from mixprec.doctor.monitor import LayerSample, PrecisionMonitor, PrecisionWarning
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
    "Verdict",
    "diagnose",
]
