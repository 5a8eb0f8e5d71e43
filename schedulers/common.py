"""Shared pieces of the step kernels: the output dataclass, the Gaussian log-density and the
small helpers every kernel uses to read its arguments (fp32 upcast, per-sample sigmas, noise).

Conventions shared by all kernels (see ``docs/algorithms.md``, "Notation"):

* ``B`` is the batch size, ``latent`` the remaining dims of the sample (``C, H, W`` or
  ``tokens, C``); all arithmetic is done in fp32 whatever the input dtype.
* A scalar schedule value (``sigma``, ``sigma_next``, a DDIM ``timestep``) may be a Python
  number, a 0-d tensor or a per-sample ``(B,)`` tensor; it is returned as a ``(B, 1, ..., 1)``
  fp32 tensor so that it broadcasts over the latent dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

Scalar = Union[float, int, torch.Tensor]  # Python number, 0-d tensor or per-sample (B,) tensor

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)  # constant term of the Gaussian log-density
_REDUCTIONS = ("mean", "sum")


@dataclass
class StepOutput:
    """Result of one reverse step ``x_t -> x_{t'}``.

    Shapes: ``prev_sample``, ``mean`` are ``(B, *latent)`` fp32; ``log_prob`` is ``(B,)`` fp32;
    ``std`` is the transition standard deviation (so ``prev_sample = mean + std * eps``), fp32 of
    shape ``(B, 1, ..., 1)`` broadcastable to ``prev_sample``. For deterministic (ODE) steps
    ``std`` is zero and ``log_prob`` is ``None``.
    """

    prev_sample: torch.Tensor
    log_prob: Optional[torch.Tensor]
    mean: torch.Tensor
    std: torch.Tensor


def gaussian_log_prob(
    x: torch.Tensor,
    mean: torch.Tensor,
    std: Union[float, torch.Tensor],
    reduction: str = "mean",
) -> torch.Tensor:
    """Log-density of ``x`` under the diagonal Gaussian ``N(mean, std^2)``, shape ``(B,)``, fp32.

    The per-element log-density is reduced over every non-batch dim by ``reduction``: ``"mean"``
    (what Flow-GRPO, DanceGRPO and DDPO use, so that ratios do not scale with the latent size) or
    ``"sum"`` (the true joint log-density). ``std`` must be > 0 and broadcast to ``x``. ``x`` is
    treated as an observed action: no gradient flows through it.
    """
    check_reduction(reduction)
    x = x.detach().float()
    mean = mean.float()
    std = torch.as_tensor(std, dtype=torch.float32, device=mean.device)
    log_prob = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    dims = tuple(range(1, log_prob.ndim))
    if not dims:
        return log_prob
    return log_prob.mean(dim=dims) if reduction == "mean" else log_prob.sum(dim=dims)


# --------------------------------------------------------------------------- helpers for kernels


def check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def check_noise_level(name: str, value: float, upper: Optional[float] = None) -> None:
    if not (value >= 0.0) or (upper is not None and value > upper):
        bound = f"[0, {upper}]" if upper is not None else ">= 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


def checked_fp32_inputs(model_output, sample, prev_sample, *, noise_name="noise_level", noise_level=0.0, upper=None, reduction="mean"):
    """A kernel's argument checks (its noise level ``noise_name`` within ``[0, upper]``, the
    reduction, matching shapes); returns fp32 ``(model_output, sample, prev_sample)``."""
    check_noise_level(noise_name, noise_level, upper)
    check_reduction(reduction)
    if model_output.shape != sample.shape:
        raise ValueError(f"model_output shape {tuple(model_output.shape)} != sample shape {tuple(sample.shape)}")
    x = sample.float()
    return model_output.float(), x, as_fp32(prev_sample, x, "prev_sample")


def per_sample(value: Scalar, sample: torch.Tensor, name: str) -> torch.Tensor:
    """``value`` (number, 0-d or ``(B,)`` tensor) as an fp32 ``(B, 1, ..., 1)`` tensor on
    ``sample``'s device. Tensor values are not range-checked (that would force a host sync)."""
    batch = sample.shape[0]
    t = torch.as_tensor(value, device=sample.device).to(torch.float32)
    if t.ndim == 0:
        t = t.expand(batch)
    elif t.ndim != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must be a number, a 0-d tensor or shape ({batch},); got {tuple(t.shape)}")
    return t.view(batch, *([1] * (sample.ndim - 1)))


def draw_noise(
    sample: torch.Tensor,
    noise: Optional[torch.Tensor],
    generator: Optional[torch.Generator],
) -> torch.Tensor:
    """Standard normal noise ``eps`` shaped like ``sample``, fp32 on ``sample``'s device.

    Uses ``noise`` when given; else draws with ``generator`` on the generator's own device (so a
    CPU generator gives the same numbers whatever device the latents live on), then moves it.
    """
    if noise is not None:
        if noise.shape != sample.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} != sample shape {tuple(sample.shape)}")
        return noise.to(device=sample.device, dtype=torch.float32)
    device = generator.device if generator is not None else sample.device
    eps = torch.randn(sample.shape, generator=generator, device=device, dtype=torch.float32)
    return eps.to(sample.device)


def as_fp32(x: Optional[torch.Tensor], like: torch.Tensor, name: str) -> Optional[torch.Tensor]:
    """``x`` upcast to fp32 after checking its shape against ``like`` (``None`` passes through)."""
    if x is None:
        return None
    if x.shape != like.shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} != sample shape {tuple(like.shape)}")
    return x.float()


def coarse(y: torch.Tensor, pool: int) -> torch.Tensor:
    """Coordinates of ``y`` (B, C, H, W) in the orthonormal basis of ``pool x pool`` block-constant
    images: block means times ``pool``. White noise maps to white noise of shape (B, C, H/pool,
    W/pool). ``pool == 1`` returns ``y``."""
    if pool == 1:
        return y
    return torch.nn.functional.avg_pool2d(y, pool) * pool


def project_coarse(y: torch.Tensor, pool: int) -> torch.Tensor:
    """Orthogonal projection of ``y`` (B, C, H, W) onto ``pool x pool`` block-constant images:
    every block replaced by its mean. ``pool == 1`` returns ``y``."""
    if pool == 1:
        return y
    return torch.nn.functional.interpolate(torch.nn.functional.avg_pool2d(y, pool), scale_factor=pool, mode="nearest")


def check_pool(sample: torch.Tensor, pool: int) -> None:
    if pool < 1:
        raise ValueError(f"noise_pool must be >= 1, got {pool!r}")
    if pool > 1 and (sample.ndim != 4 or sample.shape[-1] % pool or sample.shape[-2] % pool):
        raise ValueError(f"noise_pool {pool} needs (B, C, H, W) samples with H and W divisible by it; got {tuple(sample.shape)}")


def sample_or_score(
    mean: torch.Tensor,
    std: torch.Tensor,
    prev_sample: Optional[torch.Tensor],
    noise: Optional[torch.Tensor],
    generator: Optional[torch.Generator],
    reduction: str,
    pool: int = 1,
) -> StepOutput:
    """Finish a stochastic step: draw ``prev_sample = mean + std * eps`` unless it is given, then
    score it under ``N(mean, std^2)``.

    Sampling and re-scoring run the very same log-density code on the same fp32 ``prev_sample``,
    so re-scoring with unchanged inputs gives a bit-identical ``log_prob`` (ratio exactly 1).
    Rows whose ``std`` is 0 (e.g. CPS at ``sigma_next = 0``) are point masses with no density:
    their ``log_prob`` is set to 0 (ratio 1, no gradient); do not train on such steps.

    ``pool > 1`` (4-D samples): the noise is ``eps`` projected onto ``pool x pool`` block-constant
    images (:func:`project_coarse`), a Gaussian on that subspace only; ``log_prob`` is the density
    of the block coordinates (:func:`coarse`) of ``prev_sample`` around those of ``mean``, and the
    component orthogonal to the subspace is treated as deterministic.
    """
    check_pool(mean, pool)
    if prev_sample is None:
        prev_sample = mean + std * project_coarse(draw_noise(mean, noise, generator), pool)
    degenerate = std <= 0
    safe_std = torch.where(degenerate, torch.ones_like(std), std)
    log_prob = gaussian_log_prob(coarse(prev_sample, pool), coarse(mean, pool), safe_std, reduction)
    log_prob = torch.where(degenerate.flatten(), torch.zeros_like(log_prob), log_prob)
    return StepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)
