"""The engine's refusal: a model, or a use of it, that cannot be clipped per example."""

from __future__ import annotations

__all__ = ["UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """The model has parts the engine cannot clip per example."""
