"""Shared test settings."""

from hypothesis import settings

# Accountant evaluations cost up to ~0.5 s: keep property tests small and
# deterministic so the suite's run time is predictable.
settings.register_profile("dptrain", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("dptrain")
