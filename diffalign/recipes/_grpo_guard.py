"""GRPO-Guard in the Flow-GRPO family's updates (math in :mod:`diffalign.algorithms.grpo_guard`).

A recipe builds one :class:`StepGuard` per update when any ``algorithm.guard_*`` switch is on,
passes every micro-batch's step output through it before the clipped loss, and merges
:meth:`StepGuard.metrics` into the update's statistics. The guard hands back what the clipped
loss should see: the (normalised) log-ratio as ``log_prob`` with ``old_log_prob = 0``, and the
advantages times the step weights (a positive weight scales the clipped term exactly like it
scales the advantage).
"""

from __future__ import annotations

from typing import Optional

import torch

from diffalign.algorithms.grpo_guard import (
    RatioStats,
    analytic_norm_log_ratio,
    batch_norm_log_ratio,
    inverse_dt_weights,
    reduce_sq_diff,
)
from diffalign.errors import ConfigError


class StepGuard:
    def __init__(self, trainer, opts, timesteps: torch.Tensor, candidates: torch.Tensor, *, reduction: str = "mean",
                 step_noise: Optional[torch.Tensor] = None):
        """``opts``: the algorithm config (its ``guard_*`` keys); ``timesteps`` (T+1,) the rollout
        schedule; ``candidates`` the trainable step indices (for the weights' normalisation);
        ``step_noise`` (n_local, T, *latent) the rollout's SDE noise, for the analytic norm."""
        self.trainer, self.opts, self.reduction = trainer, opts, reduction
        self.num_steps = len(timesteps) - 1
        mode = opts.guard_norm_mode
        if mode == "auto":
            mode = "analytic" if step_noise is not None else "batch"
        if opts.guard_ratio_norm and mode == "analytic" and step_noise is None:
            raise ConfigError("config key 'algorithm.guard_norm_mode' is 'analytic', but this recipe does not keep the "
                              "rollout's step noise: use 'batch' or 'auto'")
        self.mode = mode
        self.step_noise = step_noise
        self.weights = inverse_dt_weights(timesteps.cpu(), candidates.cpu()) if opts.guard_step_reweight else None
        self.stats = RatioStats(self.num_steps) if opts.guard_diagnostics else None

    def __call__(self, step, old_log_prob: torch.Tensor, advantages: torch.Tensor, step_ids: torch.Tensor, *,
                 rows: Optional[torch.Tensor] = None, x_next: Optional[torch.Tensor] = None):
        """Returns (log_prob, old_log_prob, advantages) for ``ppo_clip_loss``.

        ``step``: the kernel's re-scored step (``log_prob``, ``mean``, ``std``); ``step_ids`` (B,) the
        denoising step of each row; ``rows`` (B,) local sample rows and ``x_next`` (B, *latent) the
        rollout's next states (analytic norm only)."""
        opts = self.opts
        log_ratio = step.log_prob.float() - old_log_prob.float()
        norm = log_ratio
        if opts.guard_ratio_norm:
            std = step.std.float().clamp_min(1e-12)
            if self.mode == "analytic":
                eps = self.step_noise[rows.cpu(), step_ids.cpu()].to(step.mean.device).float()
                old_mean = x_next.float() - std * eps  # the rollout's transition mean
                norm = analytic_norm_log_ratio(log_ratio, std, reduce_sq_diff(step.mean, old_mean, self.reduction))
            else:
                norm = batch_norm_log_ratio(log_ratio, std, step_ids)
        if self.stats is not None:
            self.stats.add(step_ids, log_ratio, norm)
        if self.weights is not None:
            advantages = advantages * self.weights[step_ids.cpu()].to(advantages.device)
        if opts.guard_ratio_norm:
            return norm, torch.zeros_like(norm), advantages
        return step.log_prob, old_log_prob, advantages

    def metrics(self) -> dict[str, float]:
        """Per-step ratio statistics over every process (a collective when diagnostics are on)."""
        if self.stats is None:
            return {}
        sums = self.stats.sums
        acc = self.trainer.accelerator
        if acc.num_processes > 1:
            sums = acc.reduce(sums.to(self.trainer.device), reduction="sum").cpu().double()
        return self.stats.metrics(sums)


def make_guard(trainer, opts, timesteps: torch.Tensor, candidates: torch.Tensor, **kwargs) -> Optional[StepGuard]:
    """A :class:`StepGuard` when any ``guard_*`` switch of ``opts`` is on, else None."""
    if not opts.guard_active:
        return None
    return StepGuard(trainer, opts, timesteps, candidates, **kwargs)


def steps_of(schedule: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """(B,) denoising-step index of each noise level ``t`` (B,): its nearest entry of ``schedule[:-1]``."""
    table = schedule[:-1].double().cpu()
    return (t.detach().double().cpu().reshape(-1, 1) - table.reshape(1, -1)).abs().argmin(dim=1)


def select_step(step, keep: torch.Tensor):
    """The rows ``keep`` of a kernel step (``log_prob``, ``mean``, ``std``; a shared std stays shared)."""
    from types import SimpleNamespace

    std = step.std[keep] if step.std.ndim and step.std.shape[0] == step.log_prob.shape[0] else step.std
    return SimpleNamespace(log_prob=step.log_prob[keep], mean=step.mean[keep], std=std)
