"""Weight-free video rewards (they see whole videos ``(B, F, 3, H, W)``, see :mod:`reward_models.base`).

``temporal_consistency``: minus the mean absolute difference between consecutive frames,

    r = -1 / (F - 1) * sum_{f=1}^{F-1} mean_{c,y,x} |v_f - v_{f-1}|,

in ``[-1, 0]`` for pixels in ``[0, 1]``; 0 for a still video. It rewards steady videos (no
flicker); alone it also rewards no motion at all, so it is meant as an example and as a term
next to a per-frame quality reward (the ``weighted`` reward), not as a training goal by itself.
"""

from __future__ import annotations

from typing import Sequence

import torch

from diffalign.errors import RewardError
from reward_models.base import register


def check_videos(videos: torch.Tensor, name: str = "videos") -> None:
    """Raise a RewardError when ``videos`` are not ``(B, F, 3, H, W)`` with ``F >= 2``."""
    if not isinstance(videos, torch.Tensor) or videos.ndim != 5 or videos.shape[2] != 3:
        shape = tuple(videos.shape) if isinstance(videos, torch.Tensor) else type(videos).__name__
        raise RewardError(f"{name}: expected videos (B, F, 3, H, W), got {shape} (a video reward needs a video model)")
    if videos.shape[1] < 2:
        raise RewardError(f"{name}: temporal rewards need at least 2 frames, got {videos.shape[1]}")


@register("temporal_consistency")
class TemporalConsistency:
    """Minus the mean absolute difference between consecutive frames (module docstring):
    ``(B, F, 3, H, W)`` in ``[0, 1]`` -> float32 ``(B,)`` in ``[-1, 0]`` on the videos' device.
    Differentiable; no weights, so ``device`` is accepted for the common protocol only."""

    video = True  # takes whole videos: call_reward passes (B, F, 3, H, W) unchanged

    def __init__(self, device: str = "cpu"):
        self.device = device

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        check_videos(images)
        step = (images[:, 1:].float() - images[:, :-1].float()).abs()  # (B, F-1, 3, H, W)
        return -step.flatten(1).mean(dim=1)
