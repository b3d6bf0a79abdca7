"""Exceptions raised by mixprec, each a subclass of a builtin users already catch."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from pathlib import Path

__all__ = [
    "DtypeChangedError",
    "FactoryError",
    "LossTypeError",
    "PolicySpecError",
    "PrecisionError",
    "SlowPrecisionError",
    "SlowPrecisionWarning",
    "caller_level",
]


class PolicySpecError(ValueError):
    """A precision spec (name, jmp string, dtype, map rule) could not be understood."""


class PrecisionError(ValueError):
    """A precision is refused on the device in hand, or slower there than float32."""


class SlowPrecisionError(PrecisionError):
    """The precision runs on this device but slower than float32; pass allow_slow=True."""


class DtypeChangedError(PrecisionError, RuntimeError):
    """Torch refused mixed dtypes in a converted model whose parameters changed dtype after
    `mixprec.apply` (``.half()``): a RuntimeError still, as torch's own was."""


class SlowPrecisionWarning(UserWarning):
    """A tool that works in any precision (`apply`, the doctor) was given one that is slow or
    refused on this device: numerics can be studied anywhere, so it is a note, not an error.
    ``MIXPREC_ALLOW_SLOW=1`` silences it for a slow precision; or filter it by this class
    (``warnings.filterwarnings("ignore", category=...)``)."""


class FactoryError(ValueError):
    """A ``file.py:factory`` / ``module:factory`` reference could not be loaded or called,
    or gave something unusable."""


class LossTypeError(TypeError):
    """A loss function or training step returned something that is not a loss (not one
    floating number): the caller's code to change, said before anything is stepped."""


# the mixprec package's folder: frames in it are not the caller a warning points at
_PACKAGE = str(Path(__file__).resolve().parent)
# torch's nn package (module calls, hooks), found without importing torch here
_TORCH_NN = str(Path(importlib.util.find_spec("torch").origin).resolve().parent / "nn")


def caller_level(past_modules: bool = False) -> int:
    """The ``stacklevel`` that makes a warning raised in the calling function point at the
    first frame outside mixprec, the user's line, however deep in mixprec it is raised
    (`apply`, the doctor, the search and `Precision` reach the same checks by paths of
    different depths); ``past_modules``: outside torch's module call machinery too (a
    warning raised in a forward, pointing at the line calling the model)."""
    inside = (_PACKAGE, _TORCH_NN) if past_modules else (_PACKAGE,)
    level, frame = 1, sys._getframe(1)
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def stand_in_for(old: str, new: str, submodules: tuple[str, ...] = ()) -> None:
    """Make the module being imported at `old` stand for the module at `new` (and
    `old.<sub>` for `new.<sub>`, each of `submodules`), with a ``DeprecationWarning`` told at
    the line that imported it: a moved module's old path, kept for one release, imports and
    patches the same module objects as the new one. Call it from the old path's module body."""
    warnings.warn(
        f"{old} moved to {new}: import it from there (this path goes in a later release)",
        DeprecationWarning,
        stacklevel=3,
    )
    module = importlib.import_module(new)
    for name in submodules:
        sys.modules[f"{old}.{name}"] = importlib.import_module(f"{new}.{name}")
    sys.modules[old] = module
