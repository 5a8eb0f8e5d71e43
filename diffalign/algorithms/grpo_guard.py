"""GRPO-Guard: regulated clipping for the Flow-GRPO family, as pure tensor functions.

Paper: Wang et al., "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via
Regulated Clipping" (arXiv:2510.22319). See ``docs/grpo_guard.md`` for what the paper specifies
and what diffalign chose where it could not be read.

Intuition. A Flow-GRPO step is a Gaussian policy ``N(mu_theta, s^2)`` with transition std ``s``
(``sigma_t sqrt(|dt|)``). For a rollout sample ``x' = mu_old + s eps`` the per-step log-ratio is

    l = log p_theta(x') - log p_old(x') = -<eps, d> / s - |d|^2 / (2 s^2),     d = mu_old - mu_theta

(``<.,.>`` and ``|.|^2`` reduced over latent elements like the log-density). Its mean
``-|d|^2 / (2 s^2)`` is negative — the ratio is left-shifted, so positive-advantage samples rarely
reach ``1 + eps`` and the clip stops constraining them — and its spread ``|d| / s`` differs from
step to step with ``s``. Ratio normalisation ("RatioNorm") removes the shift and the ``1/s``:

    l_norm = s * l + |d|^2 / (2 s) = -<eps, d>                                   (analytic)

which needs the rollout's transition mean ``mu_old = x' - s eps`` (the recipes that keep the
rollout's step noise have it). Without it, the shift is estimated from the step's micro-batch:

    l_norm = s * (l - stopgrad(mean_step(l)))                                   (batch)

identical to the analytic form at the on-policy point and in expectation over ``eps``.

Per-step reweighting multiplies each step's policy-gradient term by ``w_t`` proportional to
``1 / |dt_t|`` (the gradient of a step's mean with respect to the velocity scales with ``|dt_t|``),
normalised to mean 1 over the steps that can be trained, so the loss scale is unchanged.
"""

from __future__ import annotations

import torch

def _per_sample(std: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """Transition std as (B,) fp32 (accepts a scalar, (B,) or (B, 1, ..., 1))."""
    std = torch.as_tensor(std, dtype=torch.float32, device=like.device)
    if std.ndim == 0:
        return std.expand(like.shape[0])
    return std.reshape(std.shape[0], -1)[:, 0].float()


def reduce_sq_diff(mean: torch.Tensor, old_mean: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``|mu_theta - mu_old|^2`` per sample (B,), reduced over latent elements like the log-density
    (``"mean"`` or ``"sum"``). Keeps the gradient through ``mean``."""
    sq = (mean.float() - old_mean.detach().float()) ** 2
    dims = tuple(range(1, sq.ndim))
    return sq.mean(dim=dims) if reduction == "mean" else sq.sum(dim=dims)


def analytic_norm_log_ratio(log_ratio: torch.Tensor, std: torch.Tensor | float, sq_diff: torch.Tensor) -> torch.Tensor:
    """``s * l + |d|^2 / (2 s)``: the log-ratio without its shift ``-|d|^2/(2 s^2)`` and its ``1/s``.

    ``log_ratio`` (B,) = log p_theta - log p_old of the rollout's next state; ``std`` the transition
    std; ``sq_diff`` (B,) = :func:`reduce_sq_diff` of the current and the rollout's transition means.
    """
    s = _per_sample(std, log_ratio)
    return s * log_ratio.float() + sq_diff.float() / (2 * s)


def batch_norm_log_ratio(log_ratio: torch.Tensor, std: torch.Tensor | float, step_ids: torch.Tensor) -> torch.Tensor:
    """``s * (l - stopgrad(mean of l over the rows at the same step))`` (B,).

    ``step_ids`` (B,) integer denoising-step index of each row; the shift is estimated per step
    from the rows given (one micro-batch)."""
    s = _per_sample(std, log_ratio)
    log_ratio = log_ratio.float()
    centre = torch.zeros_like(log_ratio)
    detached = log_ratio.detach()
    step_ids = step_ids.to(log_ratio.device)
    for k in torch.unique(step_ids):
        rows = step_ids == k
        centre[rows] = detached[rows].mean()
    return s * (log_ratio - centre)


def inverse_dt_weights(timesteps: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """(T,) per-step weights ``w_i = (1/|dt_i|) / mean_{k in candidates}(1/|dt_k|)`` for the steps
    ``candidates`` (indices into the T steps of schedule ``timesteps`` (T+1,)); 0 elsewhere."""
    dt = (timesteps[1:].double() - timesteps[:-1].double()).abs()
    w = torch.zeros_like(dt)
    candidates = candidates.to(torch.long).flatten()
    if candidates.numel() == 0:
        return w.float()
    inv = 1.0 / dt[candidates].clamp_min(1e-12)
    w[candidates] = inv / inv.mean()
    return w.float()


class RatioStats:
    """Per-step running sums of the importance ratio before and after normalisation."""

    def __init__(self, num_steps: int):
        self.num_steps = num_steps
        # rows: raw sum, raw sum of squares, norm sum, norm sum of squares, count
        self.sums = torch.zeros(5, num_steps, dtype=torch.float64)

    def add(self, step_ids: torch.Tensor, log_ratio: torch.Tensor, norm_log_ratio: torch.Tensor) -> None:
        step_ids = step_ids.detach().cpu().long()
        raw = torch.exp(log_ratio.detach().double().cpu())
        norm = torch.exp(norm_log_ratio.detach().double().cpu())
        for row, v in enumerate((raw, raw**2, norm, norm**2, torch.ones_like(raw))):
            self.sums[row].index_add_(0, step_ids, v)

    def metrics(self, sums: torch.Tensor | None = None) -> dict[str, float]:
        """``guard/ratio_mean/step_NN``, ``guard/ratio_std/step_NN`` (raw ratio) and
        ``guard/norm_ratio_mean/step_NN``, ``guard/norm_ratio_std/step_NN`` (the ratio the clip sees)
        for every step with samples; population std. ``sums``: totals over processes, if reduced."""
        s = self.sums if sums is None else sums
        out: dict[str, float] = {}
        for i in range(self.num_steps):
            n = float(s[4, i])
            if n <= 0:
                continue
            for prefix, row in (("ratio", 0), ("norm_ratio", 2)):
                mean = float(s[row, i]) / n
                var = max(float(s[row + 1, i]) / n - mean**2, 0.0)
                out[f"guard/{prefix}_mean/step_{i:02d}"] = mean
                out[f"guard/{prefix}_std/step_{i:02d}"] = var**0.5
        return out


__all__ = ["reduce_sq_diff", "analytic_norm_log_ratio", "batch_norm_log_ratio",
           "inverse_dt_weights", "RatioStats"]
