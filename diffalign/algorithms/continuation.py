"""Which of k candidate next states a trajectory continues from (SPO's step-wise resampler, DRM
step-wise sampling and DRM Step-GRPO).

Pure tensor math: ``scores`` is ``(M, k)``, one row of candidate scores per trajectory.
"""

from __future__ import annotations

from typing import Optional

import torch

CONTINUATIONS = ("random", "best")  # which candidate the trajectory continues from


def choose_continuation(scores: torch.Tensor, mode: str = "random", generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``(M,)`` long, on ``scores``' device: the candidate each trajectory continues from.

    ``random`` (SPO's rule): uniform over the k candidates, drawn from ``generator`` on the CPU, so
    that the next step again starts from a state that was not selected for being good or bad;
    ``best``: the highest-scoring candidate, non-finite scores never chosen over finite ones (a
    greedy variant; it biases the visited states towards what the scorer likes). Which of the two
    the DRM paper uses is not documented *(unverified)*, hence the switch.
    """
    if mode not in CONTINUATIONS:
        raise ValueError(f"continuation must be one of {CONTINUATIONS}, got {mode!r}")
    m, k = scores.shape
    if mode == "best":
        s = torch.where(torch.isfinite(scores), scores.float(), torch.full_like(scores.float(), -float("inf")))
        return s.argmax(dim=1)
    return torch.randint(0, k, (m,), generator=generator, device="cpu").to(scores.device)
