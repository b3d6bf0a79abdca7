"""Quantized formats: the registry each format (int8, int4, float8, mxfp8, ...) is declared
in once (`mixprec.formats.registry`).

A `Format` declares its name grammar and options (`parse`, `spell`, `keywords`), its config,
its skip rule beyond the shared ones, the layer it swaps in and the float one it gives back
(`swap`, `to_float`), its weight bytes, its hardware rating (`rate`) and its per-step work
(`before_step`: float8's delayed amax all-reduce, run at every door). `float8` and
`microscaling` hold the recipe facts the policy grammar and the layers both read. A format
registered later (`register`) is named, applied, saved, explained and searched like the
builtins, which `mixprec` registers once on import.
"""

from mixprec.formats.registry import (
    Format,
    Status,
    Support,
    format_named,
    formats,
    register,
    unregister,
)

__all__ = [
    "Format",
    "Status",
    "Support",
    "format_named",
    "formats",
    "register",
    "unregister",
]
