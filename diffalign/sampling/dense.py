"""Dense rollouts: a linear SDE rollout that also returns a clean estimate of every visited state.

Used by Stepwise-Flow-GRPO (``diffalign.recipes.stepwise_flow_grpo``), where each estimate is
decoded and scored to give a per-step reward. Flow models only (``x_t = (1 - t) x0 + t eps``):

    x0_hat(x_t) = x_t - t v(x_t, t)                                  (Tweedie, K = 0 or 1)
    x0_hat_K(x_t) = K Euler steps of the probability-flow ODE from t to 0 (K >= 2)

The K substeps are uniform in sigma (``t, t (K-1)/K, ..., 0``). The first substep uses the model
output the rollout already computed at ``(x_t, t)``, so refinement costs ``K - 1`` extra forwards
per visited state (with CFG, one batched forward each) and K = 1 equals plain Tweedie.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import schedulers
from diffalign.adapters.base import ModelAdapter, PromptEmbeds
from diffalign.errors import ConfigError
from diffalign.sampling.linear import Kernel, LinearStep, Trajectory, sample_linear

MAX_SUBSTEPS = 8  # the paper reports K robust in 2..8; more only adds cost


def check_flow(adapter: ModelAdapter, what: str) -> None:
    if adapter.prediction_type != "flow":
        raise ConfigError(
            f"config key 'model.id': {what} needs a flow-matching model; {adapter.family} is an {adapter.prediction_type}-prediction model"
        )


@torch.no_grad()
def refine_x0(
    adapter: ModelAdapter,
    x: torch.Tensor,
    t: torch.Tensor,
    model_output: torch.Tensor,
    embeds: PromptEmbeds,
    *,
    guidance_scale: float,
    substeps: int,
) -> torch.Tensor:
    """Clean estimate of ``x`` (B, *latent) at times ``t`` (B,) with ``model_output`` = v(x, t).

    ``substeps`` K: 0 or 1 = Tweedie ``x - t v``; K >= 2 = K deterministic Euler substeps from t
    to 0 (see the module docstring). Returns fp32 (B, *latent).
    """
    if not 0 <= substeps <= MAX_SUBSTEPS:
        raise ConfigError(f"config key 'algorithm.tweedie_substeps' must be in [0, {MAX_SUBSTEPS}], got {substeps}")
    if substeps <= 1:
        return adapter.to_x0(model_output, x, t).float()
    t = t.float().to(x.device)
    y = x.float()
    v = model_output
    for k in range(substeps):
        s = t * (1 - k / substeps)
        s_next = t * (1 - (k + 1) / substeps)
        if k > 0:
            v = adapter.predict(y, s, embeds, guidance_scale)
        y = schedulers.ode_step(v, y, s, s_next).prev_sample
    return y


@dataclass
class DenseTrajectory(Trajectory):
    """B linear rollouts of T steps (a :class:`~diffalign.sampling.Trajectory`) with a clean
    estimate of every state.

    ``step_std``: (T,) fp32 — transition std of each step (0 on ODE steps and on degenerate SDE
    steps such as CPS's last one, whose log-prob is 0 and which must not be trained).
    ``x0_estimates``: (B, T+1, *latent) fp32 — ``[:, i]`` the (refined) Tweedie estimate at state
    i for i < T; ``[:, T]`` the real final sample.
    ``extra_forwards``: denoiser calls spent on refinement (``(K - 1) T`` for K >= 2, else 0).
    """

    step_std: torch.Tensor
    x0_estimates: torch.Tensor
    extra_forwards: int

    @property
    def trainable_steps(self) -> torch.Tensor:
        """(T,) bool: SDE steps with a proper Gaussian transition."""
        return self.sde_mask & (self.step_std > 0)

    @staticmethod
    def cat(items: list["DenseTrajectory"]) -> "DenseTrajectory":
        return DenseTrajectory(**vars(Trajectory.cat(items)), step_std=items[0].step_std,
                               x0_estimates=torch.cat([t.x0_estimates for t in items]),
                               extra_forwards=sum(t.extra_forwards for t in items))


@torch.no_grad()
def sample_linear_dense(
    adapter: ModelAdapter, kernel: Kernel, embeds: PromptEmbeds, schedule: torch.Tensor, sde_mask: torch.Tensor, *,
    guidance_scale: float, substeps: int, **sampling,
) -> DenseTrajectory:
    """The rollout of :func:`diffalign.sampling.sample_linear` (same noise use, same states and
    log-probs; ``sampling`` holds its other keywords: ``height``, ``width``, ``generator``, ``noise``,
    ``step_noise``) plus the clean estimate of every state (:func:`refine_x0` with ``substeps``)."""
    check_flow(adapter, "a dense (Tweedie) rollout")
    if "on_step" in sampling or "keep_latents" in sampling:
        raise TypeError("sample_linear_dense: on_step and keep_latents are its own (every latent is kept)")
    estimates: list[torch.Tensor] = []
    step_std = torch.zeros(len(schedule) - 1, dtype=torch.float32)

    def estimate(step: LinearStep) -> None:
        estimates.append(refine_x0(adapter, step.x, step.t, step.model_output, embeds, guidance_scale=guidance_scale,
                                   substeps=substeps))
        step_std[step.index] = float(step.out.std.flatten()[0]) if step.sde else 0.0

    traj = sample_linear(adapter, kernel, embeds, schedule, sde_mask, guidance_scale=guidance_scale, on_step=estimate,
                         **sampling)
    estimates.append(traj.latents[:, -1])  # the final state is scored on the real sample
    extra = max(substeps - 1, 0) * len(step_std)  # the first substep reuses the rollout's own forward
    return DenseTrajectory(**vars(traj), step_std=step_std, x0_estimates=torch.stack(estimates, 1), extra_forwards=extra)


@torch.no_grad()
def decode_estimates(adapter: ModelAdapter, estimates: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(B, T+1, *latent) clean estimates -> (B * (T+1), 3, H, W) images in [0, 1] on the CPU,
    row-major (sample b's T+1 images are rows ``b (T+1) ... b (T+1) + T``), decoded in chunks."""
    flat = estimates.flatten(0, 1)
    out = [adapter.decode(flat[s : s + batch_size]).float().clamp(0, 1).cpu() for s in range(0, len(flat), batch_size)]
    return torch.cat(out)
