"""DRaFT / ReFL: fine-tuning on the gradient of a differentiable reward, as pure tensor functions.

Papers: Clark et al., "Directly Fine-Tuning Diffusion Models on Differentiable Rewards" (DRaFT,
arXiv:2309.17400); Xu et al., "ImageReward" (ReFL, arXiv:2304.05977). See ``docs/drft.md``.

Intuition: with a reward r that is differentiable in the image, no policy gradient is needed: the
sampler is itself a differentiable function of the weights, ``x_0 = S_theta(x_T)``, so
``loss = -r(decode(x_0))`` can be backpropagated into theta. Backpropagating through all T steps
costs T steps of activations and is unstable; the methods cut the graph:

    DRaFT-K   x_{T-K} = S_{1..T-K}(x_T) under no_grad, then the last K steps with grad:
              grad = dr/dx_0 . d x_0 / d theta through steps T-K+1 .. T only (K = 1: DRaFT-1)
    DRaFT-LV  x_0 without grad; n times: x_t1 = (1 - t1) x_0 + t1 eps_n (fresh eps_n, t1 the noise
              level of the last step), one step with grad x0_hat_n = step(x_t1); loss the mean of
              -r(x0_hat_n): the last step's gradient averaged over n re-noisings (lower variance)
    ReFL      stop at a random step s of a late range under no_grad, predict x_0 in one step from
              x_s with grad (flow models: Tweedie x0_hat = x_s - t_s v_theta(x_s, t_s))

Here a "step" is any callable ``step(i, x) -> x_next`` (the model and kernel bound by the
recipe), so the truncation, its checkpointing and its gradients are tested on hand-written linear
steps. Gradient checkpointing keeps only each grad-carrying step's input; the step's activations
are recomputed in the backward pass (activation memory of one step instead of K).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

Step = Callable[[int, torch.Tensor], torch.Tensor]  # (step index i, x_i) -> x_{i+1}

MODES = ("drft", "refl", "drft_lv")


def truncated_rollout(step: Step, x: torch.Tensor, num_steps: int, grad_steps: int, *, checkpoint_steps: bool = False,
                      start: int = 0) -> torch.Tensor:
    """Steps ``start .. num_steps - 1`` from ``x``; only the last ``grad_steps`` of them keep a graph.

    Args:
        step: ``step(i, x_i) -> x_{i+1}``.
        x: (B, ...) the state at step ``start`` (noise at 0).
        num_steps: index one past the last step taken.
        grad_steps: K, the steps at the end that carry gradient (0: none; clipped to the steps taken).
        checkpoint_steps: recompute each grad-carrying step in the backward pass instead of keeping
            its activations (``torch.utils.checkpoint``; the step must be deterministic given x).
    Returns the state after step ``num_steps - 1``; it requires grad when some grad step touched a
    parameter.
    """
    first_grad = max(start, num_steps - grad_steps)
    with torch.no_grad():
        for i in range(start, first_grad):
            x = step(i, x)
    x = x.detach()
    for i in range(first_grad, num_steps):
        if checkpoint_steps and torch.is_grad_enabled():
            x = checkpoint(step, i, x, use_reentrant=False)
        else:
            x = step(i, x)
    return x


def refl_rollout(step: Step, predict_x0: Callable[[int, torch.Tensor], torch.Tensor], x: torch.Tensor, stop: int) -> torch.Tensor:
    """ReFL: ``stop`` steps from ``x`` without gradient, then the one-step clean estimate
    ``predict_x0(stop, x_stop)`` with gradient (flow models: ``x_s - t_s v_theta(x_s, t_s)``)."""
    return predict_x0(stop, truncated_rollout(step, x, stop, 0))


def refl_stop_candidates(num_steps: int, lo: float, hi: float) -> torch.Tensor:
    """Step indices ``s`` in ``[0, num_steps - 1]`` with ``lo <= s / num_steps <= hi``: the states
    ReFL may stop at (``s`` steps taken, the one-step x0 prediction from there). ValueError when
    the range holds none."""
    idx = torch.arange(num_steps)
    keep = (idx >= lo * num_steps - 1e-9) & (idx <= hi * num_steps + 1e-9)
    if not keep.any():
        raise ValueError(f"no step s of {num_steps} has s / num_steps in [{lo}, {hi}]")
    return idx[keep]


def refl_stop_steps(num_steps: int, lo: float, hi: float, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(n,) stop steps drawn uniformly from :func:`refl_stop_candidates`."""
    candidates = refl_stop_candidates(num_steps, lo, hi)
    return candidates[torch.randint(len(candidates), (n,), generator=generator)]


@dataclass
class DrftLossOutput:
    """One micro-batch. ``loss`` (with grad) = ``-scale * sum(r[finite]) / normalizer``; the rest detached."""

    loss: torch.Tensor
    reward_mean: torch.Tensor  # mean of the finite rewards
    finite: torch.Tensor  # (B,) bool: which rewards entered the loss


def drft_loss(rewards: torch.Tensor, *, scale: float = 1.0, normalizer: float | None = None) -> DrftLossOutput:
    """``-scale * sum of the finite rewards / normalizer`` (normalizer: the number of terms the
    optimizer step averages over, default the finite rewards of this batch). Non-finite rewards
    (NaN / inf) are left out: their gradient would poison the step. Math in fp32."""
    r = rewards.float()
    finite = torch.isfinite(r.detach())
    n = float(normalizer) if normalizer is not None else max(int(finite.sum()), 1)
    kept = torch.where(finite, r, torch.zeros_like(r))
    loss = -scale * kept.sum() / n
    mean = r.detach()[finite].mean() if finite.any() else torch.tensor(float("nan"))
    return DrftLossOutput(loss, mean, finite)


__all__ = ["MODES", "Step", "truncated_rollout", "refl_rollout", "refl_stop_candidates", "refl_stop_steps",
           "DrftLossOutput", "drft_loss"]
