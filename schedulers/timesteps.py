"""Sigma schedules that the kernels step along (fp32, from 1 = noise down to 0 = data)."""

from __future__ import annotations

import torch


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3 time shift ``shift * t / (1 + (shift - 1) * t)``: ``shift > 1`` spends more steps at
    high noise; ``shift == 1`` is the identity. Endpoints 0 and 1 are fixed."""
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift!r}")
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def shifted_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """DanceGRPO's schedule: ``linspace(1, 0, num_steps + 1)`` time-shifted by ``shift`` (3).

    Returns ``(num_steps + 1,)`` fp32 sigmas; step ``i`` goes from ``sigmas[i]`` to
    ``sigmas[i + 1]``.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps!r}")
    return shift_sigmas(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32), shift)
