"""Reverse-step kernels for flow-matching (rectified-flow) models, with log-probabilities.

Notation (``docs/algorithms.md``): ``x_t = (1 - t) x0 + t eps`` with ``t = sigma`` in [0, 1]
(t = 1 is pure noise); the model predicts the velocity ``v``. One reverse step goes from
``s = sigma`` to ``s' = sigma_next < s``, ``dt = s' - s < 0``. Code names map to symbols as:

    model_output -> v        sample -> x_t (x)       prev_sample -> x_{t'} (x')
    sigma -> s               sigma_next -> s'        noise -> eps ~ N(0, I)
    x0_hat = x - s v  (Tweedie / x0-prediction)      x1_hat = x + (1 - s) v  (noise prediction)

Every kernel is a pure function: it samples ``x' = mean + std * eps`` when ``prev_sample`` is
None and re-scores the given ``prev_sample`` otherwise, returning a :class:`StepOutput`. All math
is fp32 whatever the input dtype; ``sigma`` and ``sigma_next`` may be numbers, 0-d tensors or
per-sample ``(B,)`` tensors. ``sigma`` must be > 0 (a step never starts from clean data).
``noise_level == 0`` returns the deterministic Euler step (:func:`ode_step`) with
``log_prob=None``, ``std`` zeros and ``prev_sample`` the given one when re-scoring.

Unlike diffusers' ``FlowMatchEulerDiscreteScheduler.step`` nothing here keeps a step index, so
any step of a stored trajectory can be re-scored in any order.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .common import Scalar, StepOutput, check_pool, checked_fp32_inputs, per_sample, project_coarse, sample_or_score

STD_SCHEDULES = ("cps", "stepwise")  # std rules of cps_sde_step


def _prepare(model_output, sample, sigma, sigma_next, prev_sample, noise_level=0.0, reduction="mean", upper=None):
    """Checks the arguments (``noise_level`` at most ``upper``); returns fp32 copies of the inputs
    and ``(B, 1, ..., 1)`` sigmas."""
    v, x, prev_sample = checked_fp32_inputs(
        model_output, sample, prev_sample, noise_level=noise_level, upper=upper, reduction=reduction
    )
    return v, x, per_sample(sigma, x, "sigma"), per_sample(sigma_next, x, "sigma_next"), prev_sample


def _euler(v, x, s, s_next, prev_sample) -> StepOutput:
    mean = x + (s_next - s) * v  # x' = x + v dt, the same expression diffusers' Euler step uses
    return StepOutput(
        prev_sample=mean if prev_sample is None else prev_sample,
        log_prob=None,
        mean=mean,
        std=torch.zeros_like(s),
    )


def ode_step(model_output: torch.Tensor, sample: torch.Tensor, sigma: Scalar, sigma_next: Scalar) -> StepOutput:
    """Deterministic Euler step of the probability-flow ODE: ``x' = x + v (s' - s)``.

    Equals diffusers' ``FlowMatchEulerDiscreteScheduler.step`` (non-stochastic) in fp32.
    Returns ``log_prob=None`` and ``std`` zeros of shape ``(B, 1, ..., 1)``.
    """
    v, x, s, s_next, _ = _prepare(model_output, sample, sigma, sigma_next, None)
    return _euler(v, x, s, s_next, None)


def flow_grpo_sde_step(
    model_output: torch.Tensor, sample: torch.Tensor, sigma: Scalar, sigma_next: Scalar, *,
    noise_level: float = 0.7, sigma_max: Optional[Scalar] = None,
    prev_sample: Optional[torch.Tensor] = None, noise: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None, reduction: str = "mean", noise_pool: int = 1,
) -> StepOutput:
    """Flow-GRPO's marginal-preserving SDE step (Liu et al. 2025, "Flow-GRPO"; kernel 1).

    With ``a = noise_level``::

        sigma_t = a * sqrt(s / (1 - s))                       # paper's sigma_t (``std_t`` here)
        mean    = x + [v + sigma_t^2 / (2 s) * (x + (1 - s) v)] dt
        x'      = mean + sigma_t * sqrt(-dt) * eps

    so the returned transition ``std`` is ``sigma_t * sqrt(-dt)``. Flow-GRPO's KL term divides by
    ``sigma_t^2``, which is ``std^2 / (-dt)``. At ``s == 1`` the ratio ``s / (1 - s)`` is infinite;
    as in Flow-GRPO's code (which uses ``scheduler.sigmas[1]``) the denominator then uses
    ``sigma_max``, defaulting to ``sigma_next`` (= sigmas[1] on the first step of a schedule
    starting at 1). ``log_prob`` is the full Gaussian log-density reduced by ``reduction``,
    matching the reference code.

    ``noise_pool = f > 1`` (images (B, C, H, W) with H, W divisible by f) keeps only the coarse part
    of the noise: ``eps`` projected onto f x f block-constant images (``P eps``, the block means of
    white noise), and, for the marginals to match the ODE's along those directions, the score
    correction projected the same way: ``mean = x + [v + P(sigma_t^2 / (2 s) (x + (1 - s) v))] dt``
    (an SDE whose diffusion matrix is ``sigma_t^2 P``). ``log_prob`` is the density of the
    ``(H/f) x (W/f)`` block coordinates; the fine component is deterministic, like an ODE step's.
    The intent: keep exploration, and the policy gradient, in the directions where layout, count
    and colour are decided, without fine-pixel noise that adds variance but no signal where the
    reward reads only those (on the ShapesWorld main job it did not raise the gain; docs/flow_grpo.md).
    """
    v, x, s, s_next, prev_sample = _prepare(model_output, sample, sigma, sigma_next, prev_sample, noise_level, reduction)
    check_pool(x, noise_pool)
    if noise_level == 0:
        return _euler(v, x, s, s_next, prev_sample)
    dt = s_next - s  # < 0
    s_max = s_next if sigma_max is None else per_sample(sigma_max, x, "sigma_max")
    std_t = noise_level * torch.sqrt(s / (1 - torch.where(s == 1, s_max, s)))  # sigma_t
    if noise_pool == 1:
        # Same expression as the doc's mean, grouped by x and v as in Flow-GRPO's code.
        mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    else:
        mean = x + (v + project_coarse(std_t**2 / (2 * s) * (x + (1 - s) * v), noise_pool)) * dt
    std = std_t * torch.sqrt(-dt)
    return sample_or_score(mean, std, prev_sample, noise, generator, reduction, pool=noise_pool)


def cps_sde_step(
    model_output: torch.Tensor, sample: torch.Tensor, sigma: Scalar, sigma_next: Scalar, *,
    noise_level: float = 0.8, std_schedule: str = "cps",
    prev_sample: Optional[torch.Tensor] = None, noise: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None, reduction: str = "mean",
) -> StepOutput:
    """Coefficients-preserving ("DDIM-inspired") flow SDE step (kernel 2).

    Used by Flow-CPS (Wang & Yu 2025, Flow-GRPO's ``sde_type="cps"``) and Stepwise-Flow-GRPO::

        x' = (1 - s') x0_hat + sqrt(s'^2 - std^2) x1_hat + std * eps

    so the noise coefficient of ``x'`` stays ``s'``. ``std`` (the transition std, the paper's
    sigma_t) follows ``std_schedule``:

    * ``"cps"``: ``std = s' * sin(a pi / 2)`` with ``a = noise_level`` in [0, 1] (0.8 default).
    * ``"stepwise"``: ``std = eta * s' * sqrt(1 - s)`` with ``eta = noise_level`` in [0, 1]
      (Stepwise-Flow-GRPO). *Unverified*: the paper text was not available; note that this rule
      makes the step from ``s = 1`` deterministic.

    ``std = 0`` gives the Euler step. At ``s' = 0`` (the last step) ``std`` is 0 and those rows get
    ``log_prob = 0`` (see :func:`~schedulers.common.sample_or_score`). Deviation from Flow-GRPO's
    code: there the CPS ``log_prob`` is ``-(x' - mean)^2`` with constants and the ``1 / (2 std^2)``
    factor dropped; here it is the true Gaussian log-density, like the other kernels.
    """
    if std_schedule not in STD_SCHEDULES:
        raise ValueError(f"std_schedule must be one of {STD_SCHEDULES}, got {std_schedule!r}")
    # noise_level <= 1 keeps std <= s' (a real square root below)
    v, x, s, s_next, prev_sample = _prepare(model_output, sample, sigma, sigma_next, prev_sample, noise_level, reduction, upper=1.0)
    if noise_level == 0:
        return _euler(v, x, s, s_next, prev_sample)
    x0_hat = x - s * v
    x1_hat = x + (1 - s) * v
    if std_schedule == "cps":
        std = s_next * math.sin(noise_level * math.pi / 2)
    else:
        std = noise_level * s_next * torch.sqrt(1 - s)
    # clamp: s'^2 - std^2 is >= 0 in exact arithmetic but may round below 0 when std == s'
    mean = (1 - s_next) * x0_hat + torch.sqrt((s_next**2 - std**2).clamp_min(0)) * x1_hat
    return sample_or_score(mean, std, prev_sample, noise, generator, reduction)


def dance_sde_step(
    model_output: torch.Tensor, sample: torch.Tensor, sigma: Scalar, sigma_next: Scalar, *,
    noise_level: float = 0.3,
    prev_sample: Optional[torch.Tensor] = None, noise: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None, reduction: str = "mean",
) -> StepOutput:
    """DanceGRPO's SDE step (Xue et al. 2025, "DanceGRPO"; kernel 3).

    With ``eta = noise_level`` (0.3 default)::

        score = -(x - (1 - s) x0_hat) / s^2          # score of x_t given x0_hat
        mean  = x + v dt - 0.5 eta^2 score dt
        x'    = mean + eta * sqrt(s - s') * eps      # transition std = eta sqrt(-dt)

    Use with the shifted schedule :func:`~schedulers.timesteps.shifted_sigmas`.
    """
    v, x, s, s_next, prev_sample = _prepare(model_output, sample, sigma, sigma_next, prev_sample, noise_level, reduction)
    if noise_level == 0:
        return _euler(v, x, s, s_next, prev_sample)
    dt = s_next - s  # < 0
    x0_hat = x - s * v
    score = -(x - (1 - s) * x0_hat) / s**2
    mean = x + dt * v - 0.5 * noise_level**2 * score * dt
    std = noise_level * torch.sqrt(-dt)
    return sample_or_score(mean, std, prev_sample, noise, generator, reduction)
