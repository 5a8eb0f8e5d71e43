"""``spm``: a step-aware preference model (:mod:`diffalign.spm.model`) as a reward that takes a timestep.

As a plain reward (``reward(images, prompts, metadata)``) it scores clean images (noise level
``t``, default 0) or, per sample, at ``metadata[i]["noise_level"]`` when given. Methods that
score intermediate states (SPO's step-wise resampler) call :meth:`StepAwarePreference.score`
with the noise levels directly; they check ``takes_timestep`` first, so that a reward without
a time input (PickScore, ShapesEval, ...) is refused instead of silently scoring noisy states
as if they were clean.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from diffalign.errors import RewardError
from reward_models.base import check_images, register

NOISE_LEVEL_KEY = "noise_level"  # metadata key: tau in [0, 1] of the state the image was predicted from


@register("spm")
class StepAwarePreference:
    """Scores ``(B,)`` fp32 of a step-aware preference model.

    Args:
        model: an SPM folder written by ``diffalign train-spm``, ``tiny:shapes`` / ``tiny:clip``
            (random, for smoke runs), or a CLIP / PickScore hub id or folder (untrained time
            conditioning: the backbone's own score at every t).
        processor: tokenizer / preprocessing source for a CLIP backbone given by hub id.
        t: noise level used when the metadata gives none (0 = clean images).
        device, dtype: where and in which dtype the model runs.
        batch_size: images per forward.
    """

    takes_timestep = True

    def __init__(self, model: str = "tiny:shapes", processor: Optional[str] = None, t: float = 0.0,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None, batch_size: int = 64):
        from diffalign.spm.model import load_spm
        from reward_models.loading import parse_dtype

        if not 0.0 <= float(t) <= 1.0:
            raise RewardError(f"spm: t must be a noise level in [0, 1], got {t!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise RewardError(f"spm: batch_size must be a positive integer, got {batch_size!r}")
        self.device = torch.device(device if device is not None else "cpu")
        self.model = load_spm(str(model), processor=processor, device=self.device, dtype=parse_dtype(dtype))
        self.model.eval().requires_grad_(False)
        self.model_id = str(model)
        self.t = float(t)
        self.batch_size = batch_size
        self.last_info: dict[str, float] = {}

    @torch.no_grad()
    def score(self, images: torch.Tensor, prompts: Sequence[str], tau: torch.Tensor | float) -> torch.Tensor:
        """Scores at noise levels ``tau`` (a number or ``(B,)``), fp32 ``(B,)`` on the CPU."""
        check_images(images)
        if len(prompts) != images.shape[0]:
            raise RewardError(f"spm: got {images.shape[0]} images but {len(prompts)} prompts")
        tau = torch.as_tensor(tau, dtype=torch.float32)
        if tau.ndim == 0:
            tau = tau.expand(images.shape[0])
        out = []
        for start in range(0, images.shape[0], self.batch_size):
            sl = slice(start, start + self.batch_size)
            out.append(self.model(images[sl].to(self.device), list(prompts[sl]), tau[sl].to(self.device)).float().cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        tau = torch.tensor([float((m or {}).get(NOISE_LEVEL_KEY, self.t)) for m in metadata] if metadata else [self.t] * len(prompts))
        scores = self.score(images, prompts, tau)
        self.last_info = {"spm_mean": float(scores.mean())} if len(scores) else {}
        return scores
