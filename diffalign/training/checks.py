"""The on-policy self-check: before the first update the training forward *is* the sampling
policy, so every log-ratio of a re-scored transition must be 0 (to a tolerance)."""

from __future__ import annotations

import math

import torch

from diffalign.errors import DiffalignError


class SelfCheckError(DiffalignError):
    """The on-policy ratio before any update was not 1: sampler and training forward disagree."""


def max_log_ratio(new_logp: torch.Tensor, old_logp: torch.Tensor) -> float:
    """``max |new_logp - old_logp|`` over all entries (fp32)."""
    return float((new_logp.float() - old_logp.float()).abs().max())


def check_on_policy(worst: float, tolerance: float, where: str, sampler: str = "sampler") -> None:
    """Raise :class:`SelfCheckError` when ``worst`` (a :func:`max_log_ratio`) is non-finite or
    above ``tolerance`` (``train.self_check_tolerance``)."""
    if not math.isfinite(worst) or worst > tolerance:
        raise SelfCheckError(
            f"on-policy self-check failed: |log ratio| = {worst:.3g} before any update (tolerance "
            f"{tolerance:g}) {where}; the training forward does not reproduce the {sampler} "
            "(check the adapter's predict, CFG batching and dtype), or raise train.self_check_tolerance"
        )
