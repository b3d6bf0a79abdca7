"""The package version, in a module of its own so any module can read it without importing
the package's top level (which would be an import cycle)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
