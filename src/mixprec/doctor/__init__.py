"""The numerics doctor: find the layers that break in low precision and the policy that fixes
them (`diagnose`, `Diagnosis.recommend`), and watch them during training
(`PrecisionMonitor`)."""

from mixprec.doctor.diagnosis import (
    AT_RISK,
    BROKEN,
    OK,
    Diagnosis,
    ModuleReport,
    ParamReport,
    diagnose,
)
from mixprec.doctor.monitor import LayerSample, PrecisionMonitor, PrecisionWarning

__all__ = [
    "AT_RISK",
    "BROKEN",
    "OK",
    "Diagnosis",
    "LayerSample",
    "ModuleReport",
    "ParamReport",
    "PrecisionMonitor",
    "PrecisionWarning",
    "diagnose",
]
