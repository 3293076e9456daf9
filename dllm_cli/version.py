"""The package version, importable from any layer (the package itself sits above them)."""

__version__ = "0.1.0"
