"""The forward (noising) process in each adapter's time convention, and images -> latents.

Offline preference methods start from clean images: the step-aware preference model is trained
on pairs noised to a random t, Diffusion-DPO on pairs noised with the same noise at the same t.
This module holds what both need, for flow and epsilon adapters alike:

- ``noise level`` ``tau`` in ``[0, 1]`` (0 = clean, 1 = pure noise): a model-independent time the
  step-aware preference model is conditioned on. Flow models: ``tau = sigma = t``. Epsilon
  models: ``tau = t / num_train_timesteps`` (the DDPM index over 1000; the final clean state
  ``t = -1`` maps to 0);
- :func:`add_noise`: ``x_t`` from ``x0`` and ``eps`` (flow: ``(1 - t) x0 + t eps``; epsilon:
  ``sqrt(abar_t) x0 + sqrt(1 - abar_t) eps``);
- :func:`denoising_target`: what ``adapter.predict`` estimates (flow: ``v = eps - x0``; epsilon:
  ``eps``); :func:`pretraining_loss_weight`: the per-sample weight that turns the squared error of
  that estimate into the model's own pretraining loss (``1 / abar_t`` for a v-prediction UNet);
- :func:`scheduler_shift`: the static shift of a flow model's scheduler (the noise-level shift its
  training draws used, where it has one);
- :func:`encode_images`: images in ``[0, 1]`` -> model latents (the inverse of ``adapter.decode``;
  pixel-space models take ``2x - 1``; VAEs the mean of the posterior, normalised as the pipelines do).
"""

from __future__ import annotations

import torch

from diffalign.adapters.base import ModelAdapter


def _bcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.to(device=x.device, dtype=torch.float32).reshape(-1, *([1] * (x.ndim - 1)))


def num_train_timesteps(adapter: ModelAdapter) -> int:
    """Length of an epsilon model's DDPM schedule (1000 for SD1.5 / SDXL)."""
    return int(adapter.alphas_cumprod.shape[0])


def noise_level(adapter: ModelAdapter, t: torch.Tensor) -> torch.Tensor:
    """``tau`` in ``[0, 1]`` of model times ``t`` (see the module docstring); fp32, t's shape."""
    t = torch.as_tensor(t, dtype=torch.float32)
    if adapter.prediction_type == "flow":
        return t.clamp(0.0, 1.0)
    return t.clamp(min=0.0) / num_train_timesteps(adapter)


def model_time(adapter: ModelAdapter, tau: torch.Tensor) -> torch.Tensor:
    """Model times for noise levels ``tau`` in ``[0, 1]``: sigma for flow models; for epsilon models
    with N training timesteps the integer DDPM index ``min(floor(tau * N), N - 1)`` (as float):
    index ``i`` covers ``tau`` in ``[i / N, (i + 1) / N)`` and ``tau = 1`` maps to the last index."""
    tau = torch.as_tensor(tau, dtype=torch.float32)
    if adapter.prediction_type == "flow":
        return tau.clamp(0.0, 1.0)
    n = num_train_timesteps(adapter)
    return (tau * n).floor().clamp(0, n - 1)


def add_noise(adapter: ModelAdapter, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``x_t`` for clean latents ``x0`` ``(B, *latent)``, noise of the same shape and model times ``t`` ``(B,)``."""
    x0, noise = x0.float(), noise.float().to(x0.device)
    if adapter.prediction_type == "flow":
        s = _bcast(t, x0)
        return (1.0 - s) * x0 + s * noise
    abar = _bcast(adapter.alpha_cumprod_at(torch.as_tensor(t).cpu()), x0)
    return abar.sqrt() * x0 + (1.0 - abar).sqrt() * noise


def denoising_target(adapter: ModelAdapter, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """What ``adapter.predict`` estimates: the velocity ``eps - x0`` (flow) or ``eps`` (epsilon)."""
    if adapter.prediction_type == "flow":
        return noise.float() - x0.float()
    return noise.float()


def pretraining_loss_weight(adapter: ModelAdapter, t: torch.Tensor) -> torch.Tensor | None:
    """Per-sample weights ``(B,)`` for model times ``t`` that turn ``|predict - denoising_target|^2``
    into the loss the checkpoint was pretrained with, or None when that is the plain error.

    Flow models and epsilon UNets: None. A v-prediction UNet (``model_prediction_type ==
    "v_prediction"``; its adapter converts v to epsilon) gets ``1 / abar_t``: with
    ``eps = sqrt(abar_t) v + sqrt(1 - abar_t) x_t`` for prediction and target alike,
    ``|eps_hat - eps|^2 = abar_t |v_hat - v|^2``."""
    if adapter.prediction_type == "flow" or getattr(adapter, "model_prediction_type", "epsilon") != "v_prediction":
        return None
    return 1.0 / adapter.alpha_cumprod_at(torch.as_tensor(t).cpu()).float()


def scheduler_shift(adapter: ModelAdapter) -> float:
    """The static ``shift`` of a flow model's scheduler config (``FlowMatchEulerDiscreteScheduler``:
    SD3 3.0, the shapes model 2.0; the shift its noise levels were drawn through in training where
    the sampler copies it); 1.0 for epsilon models, schedulers without one, and resolution-dependent
    (dynamic) shifting, whose shift depends on the image size."""
    if adapter.prediction_type != "flow":
        return 1.0
    config = getattr(getattr(adapter.pipeline, "scheduler", None), "config", None) or {}
    if config.get("use_dynamic_shifting", False):
        return 1.0
    return float(config.get("shift", 1.0) or 1.0)


@torch.no_grad()
def encode_images(adapter: ModelAdapter, images: torch.Tensor) -> torch.Tensor:
    """Images ``(B, 3, H, W)`` in ``[0, 1]`` -> latents ``(B, *latent)`` fp32 on the adapter's device.

    Pixel-space models (the shapes model) use ``2x - 1``. Latent models use the mean of the VAE
    posterior (deterministic, where Diffusion-DPO's code draws a sample), normalised like the
    pipelines: ``(z - shift) * scale``, or ``(z - mean) * scale / std`` for VAEs with per-channel
    ``latents_mean`` / ``latents_std`` (SDXL variants).
    """
    x = images.to(adapter.device, torch.float32) * 2.0 - 1.0
    vae = getattr(adapter.pipeline, "vae", None)
    if vae is None:
        return x
    encoded = vae.encode(x.to(vae.dtype))
    # AutoencoderKL returns a posterior (take its mean), a tiny autoencoder latents, Sana's DC-AE a latent
    if hasattr(encoded, "latent_dist"):
        z = encoded.latent_dist.mean
    elif hasattr(encoded, "latents"):
        z = encoded.latents
    else:
        z = encoded.latent
    z = z.float()
    cfg = vae.config
    mean, std = getattr(cfg, "latents_mean", None), getattr(cfg, "latents_std", None)
    if adapter.family == "sdxl" and mean is not None and std is not None:
        mean = torch.tensor(mean, device=z.device).view(1, -1, 1, 1)
        std = torch.tensor(std, device=z.device).view(1, -1, 1, 1)
        return (z - mean) * cfg.scaling_factor / std
    shift = getattr(cfg, "shift_factor", None) or 0.0
    return (z - shift) * cfg.scaling_factor
