"""The version of ctxreplay (``pyproject.toml`` reads it from here)."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.2.0"
