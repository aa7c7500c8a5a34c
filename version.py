"""The one place lnn's version is written (pyproject reads it, the .bin producer field too)."""

__version__ = "0.1.0"
