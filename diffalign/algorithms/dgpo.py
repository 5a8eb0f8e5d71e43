"""DGPO (Direct Group Preference Optimization): a DPO-style objective on groups of ODE samples, as
pure tensor functions.

Paper: Luo, Hu, Tang, "Reinforcing Diffusion Models by Direct Group Preference Optimization"
(ICLR 2026, arXiv:2510.08425); reference code github.com/Luo-Yihong/DGPO
(``scripts/train_sd3_dgpo.py``: ``compute_group_dgpo_loss_allreduce``; ``config/dgpo.py``). See
``docs/dgpo.md``.

Intuition: GRPO's gain comes from the relative preferences within a group, not from the policy
gradient; so DGPO drops the stochastic policy (and its SDE rollouts and log-probabilities) and
learns the group preference directly. A group's samples, ODE rollouts of one prompt with group
advantages ``A_i`` (which sum to 0), split into a positive set (``A > 0``) and a negative set
(``A < 0``) weighted by ``|A_i|``. With DPO's implicit reward on the flow-matching loss, each clean
sample ``x0_i`` noised to ``x_t = (1 - t) x0_i + t eps`` at a level t of the rollout schedule:

    l_theta(i) = mean((v_theta(x_t, t) - (eps - x0_i))^2)      l_ref(i) the same with the reference
    s_g        = beta / G * sum_{i in g} A_i (l_theta(i) - l_ref(i))
    L_g        = -log sigmoid(R(G+) - R(G-)) = softplus(s_g)           (:func:`group_objective`)

``dL_g / dtheta = sigmoid(s_g) beta / G sum_i A_i dl_theta(i)``: a group whose preference the policy
already holds (``s_g`` very negative) stops pulling. The reference trains the surrogate

    loss_i = stopgrad(sigmoid(s_g)) * A_i * l_theta(i)                  (:func:`dgpo_loss`)

whose gradient is ``G / beta`` times the objective's (the constant goes into the learning rate),
plus an optional ``kl_beta * mean((v_theta - v_ref)^2)``. This module computes the surrogate and,
for parity, the objective itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from diffalign.algorithms.diffusion_dpo import per_sample_mse


def matching_loss(v: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """(B,) flow-matching loss ``mean((v - (noise - x0))^2)`` of a velocity at ``x_t = (1 - t) x0 + t noise``."""
    return per_sample_mse(v, noise.float() - x0.float())


def group_sums(values: torch.Tensor, group_ids: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(n_groups,) ``sum_{i in g} values_i`` for ``values`` (N,), ``group_ids`` (N,) in ``[0, n_groups)``."""
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, group_ids, values)


def group_logits(delta: torch.Tensor, advantages: torch.Tensor, group_ids: torch.Tensor, n_groups: int, *,
                 beta: float, group_size: int) -> torch.Tensor:
    """(n_groups,) ``s_g = beta / G sum_{i in g} A_i delta_i``, ``delta = l_theta - l_ref`` (N,)."""
    return group_sums(advantages.float() * delta.float(), group_ids, n_groups) * (beta / group_size)


def group_objective(l_theta: torch.Tensor, l_ref: torch.Tensor, advantages: torch.Tensor, group_ids: torch.Tensor,
                    n_groups: int, *, beta: float, group_size: int) -> torch.Tensor:
    """(n_groups,) the paper's ``-log sigmoid(R(G+) - R(G-)) = softplus(s_g)`` of each group."""
    return F.softplus(group_logits(l_theta - l_ref, advantages, group_ids, n_groups, beta=beta, group_size=group_size))


def group_weights(delta: torch.Tensor, advantages: torch.Tensor, group_ids: torch.Tensor, n_groups: int, *,
                  beta: float, group_size: int) -> torch.Tensor:
    """(N,) ``sigmoid(s_g)`` of each sample's group (no gradient): the weight the surrogate gives it."""
    with torch.no_grad():
        s = group_logits(delta.detach(), advantages, group_ids, n_groups, beta=beta, group_size=group_size)
        return torch.sigmoid(s)[group_ids]


@dataclass
class DGPOLossOutput:
    """One micro-batch. ``loss`` = mean of ``per_sample`` (B,) (both with grad); the rest detached."""

    loss: torch.Tensor
    per_sample: torch.Tensor
    policy_loss: torch.Tensor  # mean of w A l_theta
    matching_loss: torch.Tensor  # mean of l_theta
    group_weight: torch.Tensor  # mean of sigmoid(s_g)
    kl: torch.Tensor  # mean((v_theta - v_ref)^2)


def dgpo_loss(v_theta: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, advantages: torch.Tensor,
              weights: torch.Tensor, *, v_ref: torch.Tensor | None = None, kl_beta: float = 0.0) -> DGPOLossOutput:
    """DGPO's surrogate per sample: ``w_i A_i l_theta(i) + kl_beta * mean((v_theta - v_ref)^2)``.

    ``v_theta`` (B, ...) with grad; ``x0``, ``noise`` (B, ...); ``advantages`` (B,); ``weights`` (B,)
    the groups' ``sigmoid(s_g)`` (:func:`group_weights`, no gradient); ``v_ref`` the reference's
    velocity at the same ``x_t`` (needed when ``kl_beta > 0``)."""
    l_theta = matching_loss(v_theta, x0, noise)
    policy = weights.detach().float() * advantages.float() * l_theta
    kl = torch.zeros_like(policy)
    if kl_beta > 0:
        if v_ref is None:
            raise ValueError("kl_beta > 0 needs v_ref, the reference's velocity")
        kl = per_sample_mse(v_theta, v_ref.detach())
    per_sample = policy + kl_beta * kl
    return DGPOLossOutput(per_sample.mean(), per_sample, policy.mean().detach(), l_theta.mean().detach(),
                          weights.float().mean().detach(), kl.mean().detach())


def train_levels(trunc_steps: int, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(k,) distinct indices into the rollout schedule drawn uniformly from ``0 .. trunc_steps`` (the
    reference: ``random.sample(range(trunc_steps + 1), k)``, shared by every sample of the iteration):
    only the noisier levels ``t >= t_min = schedule[trunc_steps]``, where an imperfect ODE sample's
    fine detail does not enter the loss."""
    if not 1 <= k <= trunc_steps + 1:
        raise ValueError(f"cannot draw {k} distinct levels from indices 0 .. {trunc_steps}")
    return torch.randperm(trunc_steps + 1, generator=generator)[:k]


__all__ = ["matching_loss", "group_sums", "group_logits", "group_objective", "group_weights", "DGPOLossOutput",
           "dgpo_loss", "train_levels"]
