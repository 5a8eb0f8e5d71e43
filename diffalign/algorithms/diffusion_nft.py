"""DiffusionNFT: negative-aware fine-tuning on the forward process, as pure tensor functions.

Paper: Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process"
(arXiv:2509.16117); reference code github.com/NVlabs/DiffusionNFT (``train_nft_sd3.py``).
Intuition: no likelihoods and no sampling trajectories. Each clean rollout sample ``x0`` is noised
afresh, ``x_t = (1 - t) x0 + t eps``, and two implicit policies are built from the trained
velocity ``v_theta`` and the frozen "old" (sampling) policy ``v_old``:

    v+ = b v_theta + (1 - b) v_old          (implicit positive policy)
    v- = (1 + b) v_old - b v_theta          (implicit negative policy; mirror of v+ about v_old)

Each is scored by its flow-matching (x0-reconstruction) error, ``x0_hat = x_t - t v``; a sample
with a high reward pulls ``v+`` towards its ``x0`` and a low reward pulls ``v-`` towards it,
which pushes ``v_theta`` away. The reward enters as the optimality probability

    r = clamp(clip(A, +-c) / (2 c) + 0.5, 0, 1)           (c = adv_clip, 5)

and the loss per sample is ``scale * (r L+ + (1 - r) L-) / b + kl_beta * mean((v_theta - v_ref)^2)``
where ``L+-`` is the squared error of ``x0_hat+-`` averaged over the sample's elements and divided
by its own detached mean absolute error (adaptive weighting, clipped below at ``weight_min``).

``scale``: algorithms.md writes the loss without it; the reference code multiplies the policy
loss by ``adv_clip_max`` (5). Both readings are ``policy_loss_scale`` (default 5, the code).

The old policy is a second LoRA adapter updated after every iteration by
``old <- d old + (1 - d) theta`` with ``d = min(rate * step, max)`` (rate 0.001, max 0.5;
``step`` counts optimizer steps, the reference's ``decay_type 1``): the sampling policy lags the
trained one by a soft, growing margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


def optimality_probability(advantages: torch.Tensor, adv_clip: float = 5.0) -> torch.Tensor:
    """``r = clamp(clip(A, +-c) / (2 c) + 0.5, 0, 1)``: advantages (B,) -> weights in [0, 1]."""
    if adv_clip <= 0:
        raise ValueError("adv_clip must be > 0")
    a = advantages.float().clamp(-adv_clip, adv_clip)
    return (a / (2 * adv_clip) + 0.5).clamp(0.0, 1.0)


@dataclass
class NFTLossOutput:
    """One micro-batch. ``loss`` = mean of ``per_sample`` (B,) (both with grad); the rest detached."""

    loss: torch.Tensor
    per_sample: torch.Tensor
    policy_loss: torch.Tensor  # mean of scale * (r L+ + (1 - r) L-) / b
    kl: torch.Tensor  # mean over samples of mean((v_theta - v_ref)^2)
    positive_loss: torch.Tensor  # mean L+
    negative_loss: torch.Tensor  # mean L-
    r_mean: torch.Tensor  # mean optimality probability
    old_deviation: torch.Tensor  # mean((v_theta - v_old)^2): how far the policy has moved from the sampler


def _adaptive_mse(x0_hat: torch.Tensor, x0: torch.Tensor, weight_min: float) -> torch.Tensor:
    """Per-sample ``mean((x0_hat - x0)^2) / stopgrad(mean|x0_hat - x0|)`` (B,)."""
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        weight = (x0_hat.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp_min(weight_min).to(x0_hat.dtype)
    return ((x0_hat - x0) ** 2 / weight).mean(dim=dims)


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    advantages: torch.Tensor,
    *,
    v_ref: torch.Tensor | None = None,
    nft_beta: float = 1.0,
    adv_clip: float = 5.0,
    policy_loss_scale: float = 5.0,
    kl_beta: float = 0.0,
    weight_min: float = 1e-5,
) -> NFTLossOutput:
    """The DiffusionNFT loss of one micro-batch (see the module docstring).

    Args:
        v_theta: (B, ...) velocity of the trained policy at ``(x_t, t)`` (with grad).
        v_old: (B, ...) velocity of the old / sampling policy (detached here).
        x_t: (B, ...) the noised samples ``(1 - t) x0 + t eps``.
        x0: (B, ...) the clean rollout samples.
        t: (B,) noise levels (sigma in [0, 1]).
        advantages: (B,) per-sample advantages.
        v_ref: (B, ...) velocity of the reference model (adapter disabled); needed when ``kl_beta > 0``.
        nft_beta: b > 0, how far the implicit policies are pushed from ``v_old``.
    All math in fp32.
    """
    if nft_beta <= 0:
        raise ValueError("nft_beta must be > 0")
    if kl_beta > 0 and v_ref is None:
        raise ValueError("kl_beta > 0 needs v_ref")
    v_theta = v_theta.float()
    v_old = v_old.detach().float()
    x_t = x_t.float()
    x0 = x0.float()
    tb = t.float().reshape(-1, *([1] * (x0.ndim - 1)))
    r = optimality_probability(advantages, adv_clip).to(v_theta.device)
    v_pos = nft_beta * v_theta + (1 - nft_beta) * v_old
    v_neg = (1 + nft_beta) * v_old - nft_beta * v_theta
    loss_pos = _adaptive_mse(x_t - tb * v_pos, x0, weight_min)
    loss_neg = _adaptive_mse(x_t - tb * v_neg, x0, weight_min)
    policy = policy_loss_scale * (r * loss_pos + (1 - r) * loss_neg) / nft_beta
    dims = tuple(range(1, x0.ndim))
    if v_ref is not None:
        kl = ((v_theta - v_ref.detach().float()) ** 2).mean(dim=dims)
    else:
        kl = torch.zeros_like(policy)
    per_sample = policy + kl_beta * kl if kl_beta > 0 else policy
    with torch.no_grad():
        old_dev = ((v_theta - v_old) ** 2).mean()
    return NFTLossOutput(per_sample.mean(), per_sample, policy.detach().mean(), kl.detach().mean(), loss_pos.detach().mean(),
                         loss_neg.detach().mean(), r.mean(), old_dev)


def old_policy_decay(step: int, *, rate: float = 0.001, max_decay: float = 0.5, flat: int = 0) -> float:
    """EMA weight ``d`` of the old adapter after ``step`` optimizer steps: 0 for the first ``flat``
    steps, then ``min(rate * (step - flat), max_decay)`` (reference decay_type 1: rate 0.001, max 0.5;
    type 2: flat 75, rate 0.0075, max 0.999)."""
    if step < flat:
        return 0.0
    return min(rate * (step - flat), max_decay)


@torch.no_grad()
def ema_update_(old: Iterable[torch.Tensor], new: Iterable[torch.Tensor], decay: float) -> None:
    """In place ``old <- decay * old + (1 - decay) * new`` for matching tensors."""
    for o, n in zip(old, new, strict=True):
        o.mul_(decay).add_(n.detach().to(o.dtype), alpha=1 - decay)


__all__ = ["NFTLossOutput", "nft_loss", "optimality_probability", "old_policy_decay", "ema_update_"]
