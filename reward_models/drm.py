"""``drm``: a trained diffusion-based reward model as a reward, on clean images and noisy states.

``reward_models.build("drm", path="runs/drm_shapes")`` loads a DRM saved by
``diffalign train-reward`` (see :mod:`diffalign.drm`). It follows the reward protocol
(``images (B, 3, H, W) in [0, 1], prompts, metadata -> (B,)``: images are encoded to the DRM's
latents and scored at ``t`` (default 0, clean)), and it also scores **noisy latents** of its base
model's family directly:

    reward.score_latents(latents (B, *latent), t (B,) in the adapter's convention, prompts) -> (B,)

which is what DRM Step-GRPO and step-wise sampling need. Rewards without ``score_latents``
cannot be used there.
"""

from __future__ import annotations

from typing import Sequence

import torch

from diffalign.errors import RewardError
from reward_models.base import check_images, register


class DRMReward:
    """A loaded DRM behind the reward protocol; see the module docstring."""

    def __init__(self, path: str, device: str | torch.device = "cpu", t: float = 0.0, batch_size: int = 64):
        from diffalign.drm.model import DiffusionRewardModel, DRMError

        if not 0.0 <= float(t) <= 1.0:
            raise RewardError(f"reward 'drm': t must be a noise level in [0, 1], got {t!r}")
        try:
            self.model = DiffusionRewardModel.load(path, device=device)
        except DRMError as exc:
            raise RewardError(f"reward 'drm': {exc}") from None
        self.path = str(path)
        self.t = float(t)
        self.batch_size = int(batch_size)
        self.last_info: dict[str, float] = {}

    @property
    def family(self) -> str:
        return self.model.family

    @torch.no_grad()
    def score_latents(self, latents: torch.Tensor, t, prompts: Sequence[str]) -> torch.Tensor:
        """Scores (B,) fp32 on the CPU of noisy latents at model times ``t`` (number or (B,))."""
        return self.model.score_latents(latents, t, prompts, batch_size=self.batch_size).float().cpu()

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        check_images(images)
        if len(prompts) != images.shape[0]:
            raise RewardError(f"reward 'drm': got {len(prompts)} prompts for {images.shape[0]} images")
        scores = self.model.score_images(images, list(prompts), t=self.t, batch_size=self.batch_size)
        self.last_info = {"drm_score": float(scores.mean())} if len(scores) else {}
        return scores


@register("drm")
def drm(path: str, device: str | torch.device = "cpu", t: float = 0.0, batch_size: int = 64) -> DRMReward:
    """A DRM folder written by ``diffalign train-reward`` (``path``), scoring images at noise level ``t``."""
    return DRMReward(path, device=device, t=t, batch_size=batch_size)
