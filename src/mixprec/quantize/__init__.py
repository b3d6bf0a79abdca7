"""Quantized modules: float8 training numerics (the package API is assembled at merge)."""
