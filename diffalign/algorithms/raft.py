"""RAFT (reward-ranked fine-tuning): keep the best rollout images, fit them with the pretraining loss.

Paper: Dong et al., "RAFT: Reward rAnked FineTuning for Generative Foundation Model Alignment"
(TMLR 2023, arXiv:2304.06767). See ``docs/raft.md``.

Intuition: best-of-K sampling improves the reward at inference; RAFT distils it into the model.
For each prompt sample a group of K images, score them, keep the best ones, and train on the kept
images with the model's ordinary denoising objective, exactly as if they were a supervised
fine-tuning set. The next iteration samples from the improved model. No log-probabilities, no
ratio, no advantage: a kept image is simply data, every other image is discarded.

Per kept image ``x0`` (the clean rollout sample), fresh noise ``eps`` and a fresh noise level
``t`` (sigma in [0, 1] for rectified flow)::

    x_t   = (1 - t) x0 + t eps                  (flow; epsilon models: sqrt(abar_t) x0 + sqrt(1 - abar_t) eps)
    l     = w * mean_elements((f_theta(x_t, t, c) - target)^2)
            target = eps - x0 (flow velocity) or eps (epsilon models); w = 1, or the weight that
            turns an epsilon error into the model's own v-prediction loss (1 / abar_t)
    loss  = mean over the kept (image, draw) terms of l

This module holds the two pieces as pure tensor functions: :func:`select_kept` (which images are
kept) and :func:`raft_loss`, plus the noise-level distributions of the training draws
(:func:`sample_noise_levels`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

RANKINGS = ("group", "batch")
NOISE_LEVEL_DISTRIBUTIONS = ("uniform", "logit_normal")


@dataclass
class RaftSelection:
    """Which of an iteration's N images are trained on.

    ``keep``: (N,) bool. ``rank``: (N,) int, each image's place in its ranking pool (0 = best; the
    pool is its prompt group, or the whole batch), non-finite rewards ranked last. ``nonfinite``:
    images whose reward is NaN / inf (never kept). ``below_threshold``: images that the count would
    have kept but ``min_reward`` dropped. ``empty_groups``: prompt groups with no image kept.
    """

    keep: torch.Tensor
    rank: torch.Tensor
    nonfinite: int
    below_threshold: int
    empty_groups: int

    @property
    def kept(self) -> int:
        return int(self.keep.sum())


def keep_count(pool_size: int, *, keep_top: int, keep_fraction: float) -> int:
    """Images kept of a ranking pool of ``pool_size``: ``ceil(keep_fraction * pool_size)`` (at least
    1) when ``keep_fraction > 0``, else ``keep_top``; never more than the pool."""
    if keep_fraction > 0:
        count = max(1, math.ceil(keep_fraction * pool_size - 1e-9))  # 1e-9: 0.25 x 8 is 2, not 3 after rounding
    else:
        count = keep_top
    return min(count, pool_size)


def select_kept(
    rewards: torch.Tensor,
    group_size: int,
    *,
    keep_top: int = 1,
    keep_fraction: float = 0.0,
    min_reward: Optional[float] = None,
    ranking: str = "group",
) -> RaftSelection:
    """RAFT's data ranking: the images to fine-tune on.

    Args:
        rewards: (N,) one reward per image, in sample order: images ``g * group_size ..
            (g + 1) * group_size - 1`` are the group of prompt g (N a multiple of ``group_size``).
        keep_top: k, images kept per ranking pool when ``keep_fraction`` is 0 (RAFT: the best 1 of K).
        keep_fraction: > 0 keeps ``ceil(fraction x pool size)`` per pool instead.
        min_reward: None, or only images with ``reward >= min_reward`` are kept (on top of the count;
            a pool may then keep fewer, or none).
        ranking: ``"group"`` ranks within each prompt group (the paper's per-prompt best-of-K);
            ``"batch"`` ranks all N images together and keeps ``count x number of groups`` (the
            same number of images, given to the prompts whose images score best; with ``keep_fraction``
            ``ceil(fraction x N)``).

    Non-finite rewards are ranked last and never kept (counted in ``nonfinite``). Ties are broken
    by the lower index (the earlier sample), so a selection is a function of the rewards alone.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be (N,), got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of {group_size}")
    if ranking not in RANKINGS:
        raise ValueError(f"ranking must be one of {', '.join(RANKINGS)}, got {ranking!r}")
    if keep_top < 1 and keep_fraction <= 0:
        raise ValueError("keep_top must be >= 1 when keep_fraction is 0")
    r = rewards.detach().to("cpu", torch.float64)
    finite = torch.isfinite(r)
    # ascending sort of -r (stable): best first, equal rewards in index order; non-finite last
    key = torch.where(finite, -r, torch.full_like(r, math.inf))
    pool = group_size if ranking == "group" else n
    keys = key.reshape(-1, pool)
    order = torch.argsort(keys, dim=1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(pool).expand_as(order).contiguous())
    rank = rank.reshape(-1)
    if ranking == "group":
        count = keep_count(group_size, keep_top=keep_top, keep_fraction=keep_fraction)
    elif keep_fraction > 0:
        count = keep_count(n, keep_top=keep_top, keep_fraction=keep_fraction)
    else:
        count = min(keep_top * (n // group_size), n)
    by_count = (rank < count) & finite
    above = finite if min_reward is None else finite & (r >= min_reward)
    keep = by_count & above
    empty = int((~keep.reshape(-1, group_size).any(dim=1)).sum())
    return RaftSelection(keep, rank, int((~finite).sum()), int((by_count & ~above).sum()), empty)


def shift_noise_levels(u: torch.Tensor, shift: float) -> torch.Tensor:
    """``shift * u / (1 + (shift - 1) * u)``: the map a flow-matching scheduler's ``shift`` applies
    to its sigmas (SD3 trains and samples with one; shift > 1 moves mass to high noise; 1 = identity)."""
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return u if shift == 1.0 else shift * u / (1 + (shift - 1) * u)


def sample_noise_levels(n: int, *, distribution: str = "uniform", shift: float = 1.0, logit_mean: float = 0.0,
                        logit_std: float = 1.0, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """(n,) noise levels ``tau`` in [0, 1] (0 clean, 1 noise) for the training draws, fp32 on the CPU.

    ``uniform``: ``u ~ U(0, 1)``; ``logit_normal``: ``u = sigmoid(N(logit_mean, logit_std^2))`` (SD3's
    pretraining density, Esser et al. 2024); then :func:`shift_noise_levels` with ``shift``.
    The shipped ShapesWorld model was pretrained with ``uniform`` and shift 2
    (``scripts/pretrain_shapes.py``)."""
    if distribution == "uniform":
        u = torch.rand(n, generator=generator)
    elif distribution == "logit_normal":
        u = torch.sigmoid(logit_mean + logit_std * torch.randn(n, generator=generator))
    else:
        raise ValueError(f"distribution must be one of {', '.join(NOISE_LEVEL_DISTRIBUTIONS)}, got {distribution!r}")
    return shift_noise_levels(u, shift)


@dataclass
class RaftLossOutput:
    """One micro-batch of B (kept image, noise draw) terms. ``loss`` = mean of ``per_sample`` (B,),
    both with grad; ``mse`` the detached mean of the unweighted per-sample errors."""

    loss: torch.Tensor
    per_sample: torch.Tensor
    mse: torch.Tensor


def raft_loss(prediction: torch.Tensor, target: torch.Tensor, weights: Optional[torch.Tensor] = None) -> RaftLossOutput:
    """The denoising loss on kept images.

    Args:
        prediction: (B, ...) the model's output at ``x_t`` (with grad): velocity for flow models,
            epsilon for epsilon models.
        target: (B, ...) what it estimates (``eps - x0`` or ``eps``).
        weights: (B,) per-term weights, or None for 1.
    Returns per term ``weights * mean((prediction - target)^2)`` over every non-batch dim, in fp32.
    """
    err = (prediction.float() - target.float().to(prediction.device)) ** 2
    mse = err.mean(dim=tuple(range(1, err.ndim))) if err.ndim > 1 else err
    per_sample = mse if weights is None else weights.to(mse.device, torch.float32) * mse
    return RaftLossOutput(per_sample.mean(), per_sample, mse.detach().mean())


__all__ = ["RANKINGS", "NOISE_LEVEL_DISTRIBUTIONS", "RaftSelection", "keep_count", "select_kept", "shift_noise_levels",
           "sample_noise_levels", "RaftLossOutput", "raft_loss"]
