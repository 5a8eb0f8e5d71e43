"""Stepwise-Flow-GRPO: dense per-step credit from Tweedie reward estimates.

Paper: "Stepwise-Flow-GRPO" (dense credit assignment for flow-matching RL; see
``docs/algorithms.md``). Intuition: a terminal reward credits every denoising step equally. If
instead every visited state ``x_t`` is scored through its clean estimate ``x0_hat(t)`` (Tweedie,
optionally refined by a short ODE), the reward *change* a step causes is its own credit:

    r_t = R(x0_hat(x_t), c)      t = 0 .. T   (r_T scores the real final sample)
    g_t = r_{t+1} - r_t          t = 0 .. T-1 (gain of the step from state t to the next, less noisy one)

The gains of a prompt group are z-scored **jointly** over all ``N x T`` gains of the group (the
paper's default; per-step normalisation converged slower), and each trained step gets its own
advantage in Flow-GRPO's clipped loss (:func:`diffalign.algorithms.flow_grpo.ppo_clip_loss`).

All functions are pure and work on plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

NORMALISATIONS = ("joint", "per_step")


def stepwise_gains(step_rewards: torch.Tensor) -> torch.Tensor:
    """Per-step gains ``g_t = r_{t+1} - r_t``.

    Args:
        step_rewards: (N, T+1) rewards of the T+1 visited states of N trajectories, ordered from
            the initial noise (column 0) to the final sample (column T).

    Returns (N, T) fp32; a non-finite reward makes the gains that touch it non-finite.
    """
    if step_rewards.ndim != 2 or step_rewards.shape[1] < 2:
        raise ValueError(f"step_rewards must have shape (N, T+1) with T >= 1, got {tuple(step_rewards.shape)}")
    r = step_rewards.float()
    return r[:, 1:] - r[:, :-1]


@dataclass
class StepwiseAdvantages:
    """``advantages``: (N, T) fp32, 0 where not kept; ``keep``: (N, T) bool — the (sample, step)
    terms to train (trainable step, finite rewards, and a group (or group-step) whose gains are
    not all equal when filtering); ``zero_std_fraction``: fraction of normalisation units
    (groups for ``joint``, group-steps for ``per_step``) whose gains were all equal."""

    advantages: torch.Tensor
    keep: torch.Tensor
    zero_std_fraction: float


def stepwise_advantages(
    gains: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize: str = "joint",
    step_mask: Optional[torch.Tensor] = None,
    eps: float = 1e-4,
    clip: float = 5.0,
    filter_zero_std: bool = True,
    zero_std_tol: float = 1e-6,
) -> StepwiseAdvantages:
    """Z-scored gains ``A = (g - mean) / (std + eps)``, clipped to ``+-clip``.

    Args:
        gains: (N, T) from :func:`stepwise_gains`.
        group_ids: (N,) prompt group of each trajectory.
        normalize: ``"joint"`` — mean and std over all gains of a group at the trained steps
            (``N_g x T_trained`` numbers; the paper's default); ``"per_step"`` — mean and std over
            the ``N_g`` gains of a group at each step separately.
        step_mask: (T,) bool, the steps that are trained (SDE steps with a non-zero transition
            std). Gains of other steps enter no statistic and get A = 0. None = all steps.
        eps: added to the std (Flow-GRPO's 1e-4).
        filter_zero_std: a unit whose gains are all equal (std <= ``zero_std_tol``) is not kept.

    Trajectories with any non-finite gain are excluded from every statistic and not kept. The std
    is the population std (``unbiased=False``), as in :func:`~diffalign.algorithms.flow_grpo.group_advantages`.
    """
    if normalize not in NORMALISATIONS:
        raise ValueError(f"normalize must be one of {NORMALISATIONS}, got {normalize!r}")
    if gains.ndim != 2:
        raise ValueError(f"gains must have shape (N, T), got {tuple(gains.shape)}")
    n, num_steps = gains.shape
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids must have shape ({n},), got {tuple(group_ids.shape)}")
    gains = gains.float()
    steps = torch.ones(num_steps, dtype=torch.bool) if step_mask is None else step_mask.to(torch.bool).cpu()
    if steps.shape != (num_steps,):
        raise ValueError(f"step_mask must have shape ({num_steps},), got {tuple(steps.shape)}")
    finite_rows = torch.isfinite(gains).all(dim=1)
    keep = finite_rows[:, None] & steps[None, :].to(gains.device)
    adv = torch.zeros_like(gains)
    units = zero_units = 0
    for g in torch.unique(group_ids):
        rows = (group_ids == g) & finite_rows
        if not rows.any() or not steps.any():
            continue
        block = gains[rows][:, steps]  # (N_g, T_trained)
        if normalize == "joint":
            mean, std = block.mean(), block.std(unbiased=False)
            units += 1
            if std <= zero_std_tol:
                zero_units += 1
                if filter_zero_std:
                    keep[rows] = False
            z = (block - mean) / (std + eps)
        else:
            mean = block.mean(dim=0, keepdim=True)
            std = block.std(dim=0, unbiased=False, keepdim=True)  # (1, T_trained)
            flat = std.flatten() <= zero_std_tol
            units += flat.numel()
            zero_units += int(flat.sum())
            if filter_zero_std and flat.any():
                cols = torch.nonzero(steps).flatten()[flat]
                sub = keep[rows]
                sub[:, cols] = False
                keep[rows] = sub
            z = (block - mean) / (std + eps)
        filled = adv[rows]
        filled[:, steps] = z
        adv[rows] = filled
    adv = adv.clamp(-clip, clip)
    adv[~keep] = 0.0
    return StepwiseAdvantages(adv, keep, zero_units / max(units, 1))
