"""The package version (one place; a bundle records it)."""

__version__ = "0.1.0"
