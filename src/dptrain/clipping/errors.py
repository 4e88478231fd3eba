"""The engine's refusal: a model, or a use of it, that cannot be clipped per example."""

from __future__ import annotations

__all__ = ["UnclippedGradientError", "UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """The model has parts the engine cannot clip per example."""


class UnclippedGradientError(RuntimeError):
    """A ``p.grad`` the engine did not write would reach the optimizer: the training loop
    called ``loss.backward()`` itself (the Opacus habit: there, hooks clip inside
    ``backward``), or kept a gradient from the last step. Not a model the engine refuses
    (that is :class:`UnsupportedModelError`) but a call to change: pass the per-example
    losses to ``private.backward(losses)``."""
