"""Quantized formats: the registry each format (int8, int4, float8, mxfp8, ...) is declared
in once (`mixprec.formats.registry`)."""

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
