"""DDIM reverse step with log-probability for discrete-time diffusion models (SD1.5, SDXL).

Kernel 4 of ``docs/algorithms.md``; the same step as ddpo-pytorch's ``ddim_step_with_logprob``
(Black et al. 2023, "DDPO") but a pure function of explicit arguments instead of a patched
scheduler method. Notation (Song et al. 2021, "DDIM"), code name -> symbol:

    alphas_cumprod[t] -> abar_t        prev_timestep -> t' (< t)     sample -> x_t
    model_output -> eps_theta (or x0 / v, see ``prediction_type``)  prev_sample -> x_{t'}
    eta -> eta (0 = deterministic DDIM, 1 = DDPM-like ancestral sampling)

    x0_hat = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t)
    std    = eta * sqrt((1 - abar_t') / (1 - abar_t) * (1 - abar_t / abar_t'))
    mean   = sqrt(abar_t') x0_hat + sqrt(1 - abar_t' - std^2) eps
    x_t'   = mean + std * noise

Unlike diffusers' ``DDIMScheduler.step`` there is no ``clip_sample`` / thresholding of x0_hat
(SD1.5 / SDXL configs turn them off).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .common import Scalar, StepOutput, checked_fp32_inputs, sample_or_score

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")  # what the model's output means


def _timestep_index(value: Scalar, sample: torch.Tensor, name: str) -> torch.Tensor:
    """``value`` (int, 0-d or ``(B,)`` tensor of whole numbers) as an int64 ``(B,)`` tensor."""
    batch = sample.shape[0]
    t = torch.as_tensor(value, device=sample.device)
    if t.is_floating_point():
        if not torch.equal(t, t.round()):
            raise ValueError(f"{name} must hold whole-number timesteps, got {value!r}")
    t = t.long()
    if t.ndim == 0:
        t = t.expand(batch)
    elif t.ndim != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must be a number, a 0-d tensor or shape ({batch},); got {tuple(t.shape)}")
    return t


def ddim_step_with_logprob(
    model_output: torch.Tensor, sample: torch.Tensor, timestep: Scalar, prev_timestep: Scalar, *,
    alphas_cumprod: torch.Tensor, final_alpha_cumprod: Union[float, torch.Tensor],
    eta: float = 1.0, prediction_type: str = "epsilon",
    prev_sample: Optional[torch.Tensor] = None, noise: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None, reduction: str = "mean",
) -> StepOutput:
    """One DDIM step ``x_t -> x_t'`` that samples (``prev_sample is None``) or re-scores.

    Args:
        model_output: ``(B, *latent)`` network output, read according to ``prediction_type``.
        sample: ``(B, *latent)`` current latent ``x_t``.
        timestep, prev_timestep: integer indices into ``alphas_cumprod`` (numbers, 0-d or ``(B,)``
            tensors); ``prev_timestep < 0`` means the step to clean data, using
            ``final_alpha_cumprod`` (as ``DDIMScheduler.final_alpha_cumprod``).
        alphas_cumprod: ``(T,)`` cumulative products ``abar`` (``DDIMScheduler.alphas_cumprod``).
        eta: in [0, 1]. ``eta == 0`` is plain deterministic DDIM: ``log_prob`` is None, ``std``
            zeros, ``prev_sample`` the mean (or the given one when re-scoring).
        noise: ``(B, *latent)`` standard normal noise to use instead of drawing (diffusers'
            ``variance_noise``).

    Rows with zero ``std`` (``eta > 0`` but ``abar_t' = 1``, e.g. ``set_alpha_to_one=True`` on
    the last step) get ``log_prob = 0``. ``log_prob`` is the diagonal Gaussian log-density,
    reduced over latent dims by ``reduction`` ("mean" as in ddpo-pytorch, or "sum").
    """
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")
    # eta > 1 makes 1 - abar_t' - std^2 negative
    out, x, prev_sample = checked_fp32_inputs(
        model_output, sample, prev_sample, noise_name="eta", noise_level=eta, upper=1.0, reduction=reduction
    )

    acp = alphas_cumprod.to(device=x.device, dtype=torch.float32)
    final = torch.as_tensor(final_alpha_cumprod, device=x.device, dtype=torch.float32)
    t = _timestep_index(timestep, x, "timestep")
    t_prev = _timestep_index(prev_timestep, x, "prev_timestep")
    bshape = (x.shape[0],) + (1,) * (x.ndim - 1)  # (B, 1, ..., 1): broadcast over latent dims
    alpha_prod_t = acp[t].view(bshape)  # abar_t
    alpha_prod_prev = torch.where(t_prev >= 0, acp[t_prev.clamp(min=0)], final).view(bshape)  # abar_t'
    beta_prod_t = 1 - alpha_prod_t
    beta_prod_prev = 1 - alpha_prod_prev

    # x0_hat and eps_hat, in the same expressions as diffusers' DDIMScheduler.step
    if prediction_type == "epsilon":
        x0_hat = (x - beta_prod_t**0.5 * out) / alpha_prod_t**0.5
        eps_hat = out
    elif prediction_type == "sample":
        x0_hat = out
        eps_hat = (x - alpha_prod_t**0.5 * x0_hat) / beta_prod_t**0.5
    else:  # v_prediction
        x0_hat = alpha_prod_t**0.5 * x - beta_prod_t**0.5 * out
        eps_hat = alpha_prod_t**0.5 * out + beta_prod_t**0.5 * x

    variance = (beta_prod_prev / beta_prod_t) * (1 - alpha_prod_t / alpha_prod_prev)  # sigma_t^2 at eta 1
    std = eta * variance**0.5
    mean = alpha_prod_prev**0.5 * x0_hat + (1 - alpha_prod_prev - std**2) ** 0.5 * eps_hat
    if eta == 0:
        return StepOutput(
            prev_sample=mean if prev_sample is None else prev_sample,
            log_prob=None,
            mean=mean,
            std=torch.zeros_like(std),
        )
    return sample_or_score(mean, std, prev_sample, noise, generator, reduction)
