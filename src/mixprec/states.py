"""Moved: ``mixprec.states`` is ``mixprec.optim.states`` now (the optimizer side lives in
`mixprec.optim`). This path keeps working for one release, with a ``DeprecationWarning``
naming the new one: it stands for the new package (the same module objects, submodules included), so
what is imported or patched through it is what the new path holds.
"""

from __future__ import annotations

from mixprec.errors import stand_in_for

__all__: list[str] = []

stand_in_for(
    __name__,
    "mixprec.optim.states",
    ("assign", "buckets", "codecs", "formats", "kernels", "optimizers"),
)
