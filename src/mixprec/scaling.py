"""Moved: ``mixprec.scaling`` is ``mixprec.optim.scaling`` now (the optimizer side lives in
`mixprec.optim`). This path keeps working for one release, with a ``DeprecationWarning``
naming the new one: it stands for the new module (the same module objects), so
what is imported or patched through it is what the new path holds.
"""

from __future__ import annotations

import importlib
import sys
import warnings

__all__: list[str] = []

_NEW = "mixprec.optim.scaling"
_SUBMODULES: tuple[str, ...] = ()

warnings.warn(
    f"{__name__} moved to {_NEW}: import it from there (this path goes in a later release)",
    DeprecationWarning,
    stacklevel=2,
)
_module = importlib.import_module(_NEW)
for _name in _SUBMODULES:
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"{_NEW}.{_name}")
sys.modules[__name__] = _module
