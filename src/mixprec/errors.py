"""Exceptions raised by mixprec, each a subclass of a builtin users already catch."""

from __future__ import annotations

__all__ = [
    "FactoryError",
    "PolicySpecError",
    "PrecisionError",
    "SlowPrecisionError",
    "SlowPrecisionWarning",
]


class PolicySpecError(ValueError):
    """A precision spec (name, jmp string, dtype, map rule) could not be understood."""


class PrecisionError(ValueError):
    """A precision is refused on the device in hand, or slower there than float32."""


class SlowPrecisionError(PrecisionError):
    """The precision runs on this device but slower than float32; pass allow_slow=True."""


class SlowPrecisionWarning(UserWarning):
    """A tool that works in any precision (`apply`, the doctor) was given one that is slow or
    refused on this device: numerics can be studied anywhere, so it is a note, not an error.
    ``MIXPREC_ALLOW_SLOW=1`` silences it for a slow precision; or filter it by this class
    (``warnings.filterwarnings("ignore", category=...)``)."""


class FactoryError(ValueError):
    """A ``file.py:factory`` / ``module:factory`` reference could not be loaded or called,
    or gave something unusable."""
