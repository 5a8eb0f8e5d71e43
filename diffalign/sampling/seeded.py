"""Seed-driven sampling: one integer seed per sample fixes its noise, hence its image.

With the deterministic ODE sampler an image is a function of (model, prompt, seed, steps) only,
whatever batch it is drawn in and whichever process draws it. This is what lets Sol-RL rank seeds
with a cheap model and regenerate exactly those seeds with the exact one, and what DiffusionNFT
uses for its rollouts. Noise is drawn on the CPU (``torch.Generator("cpu").manual_seed(seed)``)
so that a seed means the same noise on every device.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from diffalign.adapters.base import ModelAdapter, PromptEmbeds
from diffalign.sampling.linear import Kernel, Trajectory, build_kernel, sample_linear

SEED_HIGH = 2**31 - 1  # seeds are drawn in [0, SEED_HIGH), as in the Sol-RL reference


def seed_noise(seeds: Sequence[int] | torch.Tensor, shape: tuple[int, ...], *,
               step_noise_steps: int = 0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Noise of each seed: ``(B, *shape)`` initial noise and, when ``step_noise_steps > 0``,
    ``(B, step_noise_steps, *shape)`` SDE noise drawn after it from the same generator (fp32, CPU).

    Row ``i`` depends only on ``seeds[i]``."""
    seeds = [int(s) for s in (seeds.tolist() if isinstance(seeds, torch.Tensor) else seeds)]
    init, steps = [], []
    for s in seeds:
        gen = torch.Generator("cpu").manual_seed(s)
        init.append(torch.randn(shape, generator=gen))
        if step_noise_steps:
            steps.append(torch.randn((step_noise_steps, *shape), generator=gen))
    if not seeds:
        return torch.empty((0, *shape)), (torch.empty((0, step_noise_steps, *shape)) if step_noise_steps else None)
    return torch.stack(init), (torch.stack(steps) if step_noise_steps else None)


def ode_kernel(adapter: ModelAdapter) -> Kernel:
    """The deterministic kernel of the adapter's family (Euler ODE for flow models, DDIM eta 0)."""
    return build_kernel(adapter, "ddim" if adapter.prediction_type == "epsilon" else "flow_grpo", 0.0)


@torch.no_grad()
def sample_seeded(
    adapter: ModelAdapter,
    embeds: PromptEmbeds,
    seeds: Sequence[int] | torch.Tensor,
    *,
    num_steps: int,
    guidance_scale: float,
    resolution: int,
    batch_size: int = 16,
    kernel: Optional[Kernel] = None,
    sde_mask: Optional[torch.Tensor] = None,
    keep_latents: bool = False,
) -> Trajectory:
    """Sample one image per (row of ``embeds``, seed) in chunks of ``batch_size``.

    By default the deterministic ODE (``sde_mask`` all False): then the seed fixes the image.
    With an SDE ``kernel`` and ``sde_mask`` the stochastic steps use noise drawn from the same
    seed after the initial noise, so a seed fixes the whole trajectory too. ``keep_latents=False``
    keeps only the first and last states (``latents`` of shape ``(B, 2, ...)``).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    seeds = [int(s) for s in (seeds.tolist() if isinstance(seeds, torch.Tensor) else seeds)]
    if len(seeds) != len(embeds):
        raise ValueError(f"need one seed per sample: {len(seeds)} seeds for {len(embeds)} prompt embeddings")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    kernel = kernel or ode_kernel(adapter)
    mask = sde_mask if sde_mask is not None else torch.zeros(num_steps, dtype=torch.bool)
    if mask.shape != (num_steps,):
        raise ValueError(f"sde_mask must have shape ({num_steps},), got {tuple(mask.shape)}")
    schedule = adapter.make_schedule(num_steps, resolution, resolution)
    shape = adapter.latent_shape(resolution, resolution)
    stochastic = bool(mask.any())
    chunks = []
    for start in range(0, len(seeds), batch_size):
        rows = slice(start, start + batch_size)
        noise, step_noise = seed_noise(seeds[rows], shape, step_noise_steps=num_steps if stochastic else 0)
        chunks.append(sample_linear(adapter, kernel, embeds.select(rows), schedule, mask, guidance_scale=guidance_scale,
                                    height=resolution, width=resolution, noise=noise, step_noise=step_noise,
                                    keep_latents=keep_latents))
    return Trajectory.cat(chunks)


__all__ = ["SEED_HIGH", "seed_noise", "ode_kernel", "sample_seeded"]
