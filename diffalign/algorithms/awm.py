"""AWM (Advantage Weighted Matching): the flow-matching loss on the policy's own samples, weighted
by group advantages, as pure tensor functions.

Paper: Xue et al., "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models"
(arXiv:2509.25050); reference code github.com/scxue/advantage_weighted_matching
(``scripts/train_sd3_awm.py``, ``config/dgx_awm.py``). See ``docs/awm.md``.

Intuition: DDPO / Flow-GRPO maximise per-step Gaussian likelihoods of noisy transitions, which is
denoising score matching with a noisy target. AWM keeps the pretraining objective itself: each
clean rollout sample ``x0`` is noised afresh, ``x_t = (1 - t) x0 + t eps``, the velocity is matched
to ``eps - x0``, and the per-sample matching loss is multiplied by the sample's advantage — high
reward samples are fitted, low reward samples are pushed away:

    l      = mean_elements((v_theta(x_t, t) - (eps - x0))^2)
    w(l,t) = t / p * ((l + c)^p - c^p)          ("ghuber", p = 0.25, c = 1e-10: the reference default)
    a      = clip(A, +-adv_clip) / adv_clip * advantage_max        (5 and 1: A / 5)
    loss   = a * w(l, t) + kl_beta * mean((v_theta - v_ref)^2) + ema_kl_beta * mean((v_theta - v_ema)^2)

The reference writes the policy term as ``-a * exp(-w + stopgrad(w))`` (a PPO ratio against the
same forward, clip range 1, so never clipped): the same gradient as ``a * w``, which is what this
module returns (its value is then the advantage-weighted matching loss itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")


def matching_weight(loss: torch.Tensor, t: torch.Tensor, weighting: str = "ghuber", *, ghuber_power: float = 0.25,
                    c: float = 1e-10) -> torch.Tensor:
    """The reference's weightings ``w(l, t)`` of the per-sample matching loss ``l`` (B,) at noise level t (B,):

    ``uniform``: l; ``t``: t l; ``t2``: t^2 l; ``huber``: t (sqrt(l + c) - 1e-5);
    ``ghuber``: t / p ((l + c)^p - c^p).
    """
    t = t.to(loss.dtype).reshape(-1)
    if weighting == "uniform":
        return loss
    if weighting == "t":
        return t * loss
    if weighting == "t2":
        return t**2 * loss
    if weighting == "huber":
        return t * (torch.sqrt(loss + c) - 1e-5)
    if weighting == "ghuber":
        if ghuber_power <= 0:
            raise ValueError("ghuber_power must be > 0")
        return t / ghuber_power * ((loss + c) ** ghuber_power - c**ghuber_power)
    raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")


def scaled_advantages(advantages: torch.Tensor, adv_clip: float = 5.0, advantage_max: float = 1.0) -> torch.Tensor:
    """``clip(A, +-adv_clip) / adv_clip * advantage_max`` (the reference: A in [-5, 5] -> [-1, 1])."""
    if adv_clip <= 0:
        raise ValueError("adv_clip must be > 0")
    return advantages.float().clamp(-adv_clip, adv_clip) / adv_clip * advantage_max


@dataclass
class AWMLossOutput:
    """One micro-batch. ``loss`` = mean of ``per_sample`` (B,) (both with grad); the rest detached."""

    loss: torch.Tensor
    per_sample: torch.Tensor
    policy_loss: torch.Tensor  # mean of a * w
    matching_loss: torch.Tensor  # mean of the unweighted matching loss l
    kl: torch.Tensor  # mean((v_theta - v_ref)^2)
    ema_kl: torch.Tensor  # mean((v_theta - v_ema)^2)


def awm_loss(
    v_theta: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    t: torch.Tensor,
    advantages: torch.Tensor,
    *,
    v_ref: torch.Tensor | None = None,
    v_ema: torch.Tensor | None = None,
    weighting: str = "ghuber",
    ghuber_power: float = 0.25,
    adv_clip: float = 5.0,
    advantage_max: float = 1.0,
    kl_beta: float = 0.0,
    ema_kl_beta: float = 0.0,
) -> AWMLossOutput:
    """The AWM loss of one micro-batch (see the module docstring).

    Args:
        v_theta: (B, ...) velocity of the trained policy at ``x_t = (1 - t) x0 + t noise`` (with grad).
        x0: (B, ...) the clean rollout samples. noise: (B, ...) the fresh noise of ``x_t``.
        t: (B,) noise levels (sigma in [0, 1]). advantages: (B,) per-sample group advantages.
        v_ref / v_ema: velocities of the reference (adapter disabled) and of the EMA adapter at the
            same ``x_t``; needed when ``kl_beta`` / ``ema_kl_beta`` > 0.
    Math in fp32.
    """
    if kl_beta > 0 and v_ref is None:
        raise ValueError("kl_beta > 0 needs v_ref")
    if ema_kl_beta > 0 and v_ema is None:
        raise ValueError("ema_kl_beta > 0 needs v_ema")
    v = v_theta.float()
    dims = tuple(range(1, v.ndim))
    target = noise.float() - x0.float()
    ell = ((v - target) ** 2).mean(dim=dims)
    a = scaled_advantages(advantages, adv_clip, advantage_max).to(v.device)
    policy = a * matching_weight(ell, t.to(v.device), weighting, ghuber_power=ghuber_power)
    zeros = torch.zeros_like(policy)
    kl = ((v - v_ref.detach().float()) ** 2).mean(dim=dims) if v_ref is not None else zeros
    ema_kl = ((v - v_ema.detach().float()) ** 2).mean(dim=dims) if v_ema is not None else zeros
    per_sample = policy
    if kl_beta > 0:
        per_sample = per_sample + kl_beta * kl
    if ema_kl_beta > 0:
        per_sample = per_sample + ema_kl_beta * ema_kl
    return AWMLossOutput(per_sample.mean(), per_sample, policy.detach().mean(), ell.detach().mean(), kl.detach().mean(),
                         ema_kl.detach().mean())


def stratified_levels(num_steps: int, k: int, *, fraction: float = 0.9, skip_first: bool = True, n: int = 1,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """(n, k) indices into a rollout schedule's sigmas, one per stratum (the reference's ``discrete``
    / ``discrete_wo_init`` time types): ``k + 1`` boundaries evenly from ``lo`` (1 with
    ``skip_first``, skipping sigma = 1, else 0) to ``int(num_steps * fraction)``, truncated to
    integers; in stratum j a uniform integer in ``[lower_j, upper_j)`` (``lower_j`` when empty)."""
    lo = 1 if skip_first else 0
    hi = int(num_steps * fraction + 1e-9)
    if k < 1 or hi <= lo:
        raise ValueError(f"no noise levels to train: num_steps {num_steps}, fraction {fraction}, k {k}")
    bounds = torch.linspace(lo, hi, k + 1).long()
    lower, upper = bounds[:-1], bounds[1:]
    u = torch.rand((n, k), generator=generator)
    return lower + (u * (upper - lower)).long()


__all__ = ["WEIGHTINGS", "matching_weight", "scaled_advantages", "AWMLossOutput", "awm_loss", "stratified_levels"]
