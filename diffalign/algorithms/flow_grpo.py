"""Flow-GRPO: group-relative advantages and the clipped policy-gradient loss.

Paper: Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL" (2025).
Intuition: sample a group of G images per prompt with an SDE so every denoising step is a
Gaussian policy; an image's advantage is its reward relative to its group; every trained
step's log-probability ratio is pushed along the advantage, PPO-clipped, with a KL to the
reference (the model with the LoRA adapter disabled).

All functions are pure and work on plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Advantages:
    """``advantages``: (N,) fp32; ``keep``: (N,) bool — False for samples in zero-std groups (when
    filtering) or with non-finite rewards; ``zero_std_fraction``: fraction of groups whose
    rewards were all equal."""

    advantages: torch.Tensor
    keep: torch.Tensor
    zero_std_fraction: float


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    std_mode: str = "global",
    unbiased: bool = False,
    eps: float = 1e-4,
    clip: float = 5.0,
    filter_zero_std: bool = True,
    zero_std_tol: float = 1e-6,
) -> Advantages:
    """Per-prompt advantages ``A_i = (r_i - mean_group(i)) / (std + eps)``, clipped to ``+-clip``.

    Args:
        rewards: (N,) rewards; non-finite entries are excluded from every statistic and get A = 0.
        group_ids: (N,) integer id of each sample's prompt group.
        std_mode: ``"global"`` — std over all finite rewards of the batch (Flow-GRPO's default);
            ``"group"`` — std within each group (Pref-GRPO's win rates).
        unbiased: Bessel's std (``N - 1``, torch.std's default, as Pref-GRPO) instead of the
            population std (``N``, Flow-GRPO).
        filter_zero_std: mark samples of groups whose rewards are all equal as not kept.
    """
    if std_mode not in ("global", "group"):
        raise ValueError(f"std_mode must be 'global' or 'group', got {std_mode!r}")
    rewards = rewards.float()
    finite = torch.isfinite(rewards)
    adv = torch.zeros_like(rewards)
    keep = finite.clone()
    global_std = rewards[finite].std(unbiased=unbiased) if finite.sum() > 1 else torch.tensor(0.0)
    groups = torch.unique(group_ids)
    zero_std = 0
    for g in groups:
        member = (group_ids == g) & finite
        r = rewards[member]
        if r.numel() == 0:
            continue
        group_std = r.std(unbiased=unbiased) if r.numel() > 1 else torch.tensor(0.0)
        if group_std <= zero_std_tol:
            zero_std += 1
            if filter_zero_std:
                keep[group_ids == g] = False
        std = global_std if std_mode == "global" else group_std
        adv[member] = (r - r.mean()) / (std + eps)
    adv = adv.clamp(-clip, clip)
    adv[~keep] = 0.0
    return Advantages(adv, keep, zero_std / max(len(groups), 1))


def gdpo_advantages(
    rewards: torch.Tensor,
    weights: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    unbiased: bool = False,
    eps: float = 1e-4,
    clip: float = 5.0,
    filter_zero_std: bool = True,
    zero_std_tol: float = 1e-6,
) -> Advantages:
    """GDPO's advantages of K weighted rewards (Liu et al., "GDPO: Group reward-Decoupled
    Normalization Policy Optimization for Multi-reward RL Optimization", arXiv:2601.05242):

        A_k   = (r_k - mean_group(r_k)) / (std_group(r_k) + eps)      each reward within its group
        A_sum = sum_k w_k A_k                                          the weighted normalised rewards
        A     = clip((A_sum - mean_batch) / (std_batch + eps), +-clip)  then over the whole batch

    Summing first and normalising the sum (``group_advantages`` of ``r @ w``) lets the reward with
    the largest spread decide the sign of every advantage; normalising each reward first gives each
    its weight's share of the signal whatever its scale.

    Args:
        rewards: (N, K) unweighted component rewards; a row with a non-finite entry is excluded
            from every statistic and gets A = 0.
        weights: (K,) the components' weights ``w_k``.
        group_ids: (N,) integer id of each sample's prompt group.
        unbiased: Bessel's std in both normalisations instead of the population std.
        filter_zero_std: mark the samples of groups in which every component is constant as not kept.
    """
    rewards = rewards.float()
    if rewards.ndim != 2 or weights.shape != (rewards.shape[1],):
        raise ValueError(f"rewards must be (N, K) and weights (K,), got {tuple(rewards.shape)} and {tuple(weights.shape)}")
    finite = torch.isfinite(rewards).all(dim=1)
    masked = torch.where(finite[:, None], rewards, torch.full_like(rewards, float("nan")))
    total = torch.zeros(rewards.shape[0])
    varies = torch.zeros(rewards.shape[0], dtype=torch.bool)  # some component varies within the sample's group
    for k in range(rewards.shape[1]):
        # each component normalised within its group (std per group), unclipped; keep = the group varies in r_k
        part = group_advantages(masked[:, k], group_ids, std_mode="group", unbiased=unbiased, eps=eps, clip=float("inf"),
                                filter_zero_std=True, zero_std_tol=zero_std_tol)
        total += float(weights[k]) * part.advantages
        varies |= part.keep
    adv = torch.zeros_like(total)
    if finite.sum() > 1:
        batch = total[finite]
        adv[finite] = (batch - batch.mean()) / (batch.std(unbiased=unbiased) + eps)
    keep = finite & varies if filter_zero_std else finite.clone()
    adv = adv.clamp(-clip, clip)
    adv[~keep] = 0.0
    groups = torch.unique(group_ids)
    zero_std = sum(1 for g in groups if not bool(varies[(group_ids == g) & finite].any()) and bool(((group_ids == g) & finite).any()))
    return Advantages(adv, keep, zero_std / max(len(groups), 1))


@dataclass
class PPOLossOutput:
    """One micro-batch: ``loss`` (with grad) = ``policy_loss + beta * kl``, the mean of
    ``per_sample`` (B,) (with grad; for normalising by a global sample count across processes)."""

    loss: torch.Tensor
    per_sample: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    clip_frac: torch.Tensor  # fraction of samples whose ratio left [1 - eps, 1 + eps]
    approx_kl: torch.Tensor  # 0.5 * mean((logp - logp_old)^2), a cheap policy-drift monitor
    ratio_mean: torch.Tensor


def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
) -> PPOLossOutput:
    """``mean(max(-A * rho, -A * clip(rho, 1 - eps, 1 + eps))) + beta * mean(kl)``.

    ``rho = exp(logp_theta - logp_old)``; all inputs (B,); computed in fp32.
    """
    log_prob = log_prob.float()
    old_log_prob = old_log_prob.float()
    advantages = advantages.float()
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_policy = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clip_frac = ((ratio - 1.0).abs() > clip_range).float().mean()
    return _policy_loss_output(per_policy, log_ratio, kl, beta, clip_frac)


def _policy_loss_output(per_policy: torch.Tensor, log_ratio: torch.Tensor, kl: torch.Tensor | None, beta: float,
                        clip_frac: torch.Tensor) -> PPOLossOutput:
    """The output of a ratio loss with per-sample policy terms ``per_policy`` (B,): plus ``beta`` x
    ``kl``, and the monitors (``clip_frac`` the fraction the trust region stopped)."""
    per_sample = per_policy + beta * kl.float() if (beta > 0 and kl is not None) else per_policy
    kl_mean = kl.float().mean() if kl is not None else torch.zeros((), device=per_policy.device)
    with torch.no_grad():
        approx_kl = 0.5 * (log_ratio**2).mean()
        ratio_mean = torch.exp(log_ratio).mean()
    return PPOLossOutput(per_sample.mean(), per_sample, per_policy.mean().detach(), kl_mean.detach(), clip_frac, approx_kl,
                         ratio_mean)


def kl_mask_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    policy_kl: torch.Tensor,
    *,
    threshold: float,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
) -> PPOLossOutput:
    """Flow-DPPO's policy loss: the unclipped ratio loss with a KL trust-region mask in place of
    PPO's clip (paper arXiv:2606.11025; verl-omni's ``FlowDPPOLoss``, UniRL's ``flowdppo.py``).

    ``D = policy_kl`` (B,) is the KL of the old and the current Gaussian step,
    ``mean((mu_theta - mu_old)^2) / (2 std^2)``; a term is masked (no gradient, 0 in the loss) when
    it is outside the trust region *and* moving farther out along its advantage:

        masked = D >= threshold and ((A > 0 and rho > 1) or (A < 0 and rho < 1))
        loss   = mean(where(masked, 0, -A * rho)) + beta * mean(kl)

    Updates that move back towards the old policy stay active whatever D. All inputs (B,), fp32;
    ``clip_frac`` of the output is the masked fraction.
    """
    log_prob = log_prob.float()
    advantages = advantages.float()
    log_ratio = log_prob - old_log_prob.float()
    ratio = torch.exp(log_ratio)
    outside = policy_kl.detach().float() >= threshold
    masked = outside & (((advantages > 0) & (ratio > 1)) | ((advantages < 0) & (ratio < 1)))
    # where, not a product: an overflowed ratio that is masked must not give inf * 0 = nan
    per_policy = torch.where(masked, torch.zeros_like(ratio), -advantages * ratio)
    return _policy_loss_output(per_policy, log_ratio, kl, beta, masked.float().mean())


TRUST_REGIONS = ("clip", "kl_mask")  # algorithm.trust_region of Flow-GRPO


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL between two Gaussians with the same std: ``mean((mu - mu_ref)^2) / (2 std^2)`` per sample.

    ``mean``, ``ref_mean``: (B, ...); ``std``: transition std broadcastable to them. Returns (B,).
    The mean is over non-batch dims, matching the averaged log-probabilities.
    """
    dims = tuple(range(1, mean.ndim))
    std = std.float()
    if std.ndim:  # per-sample std (B, 1, ..., 1) -> (B,)
        std = std.reshape(std.shape[0], -1)[:, 0] if std.shape[0] == mean.shape[0] else std.reshape(-1)[0]
    return ((mean.float() - ref_mean.float()) ** 2).mean(dim=dims) / (2 * std**2)


KL_DEFINITIONS = ("exact", "reference")  # algorithm.kl_definition


def reference_code_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, abs_dt: torch.Tensor) -> torch.Tensor:
    """The KL term of Flow-GRPO's reference code: ``mean((mu - mu_ref)^2) / (2 sigma_t^2)`` per sample.

    Its ``std_dev_t`` is ``sigma_t``, the SDE's diffusion coefficient, without ``sqrt(|dt|)``; the
    step's noise std is ``std = sigma_t * sqrt(|dt|)``, so this is :func:`gaussian_mean_kl` times
    ``|dt|``: smaller than the exact KL of the step by the step's length (about 12-17x over the
    first steps of a 10-step shifted schedule). The reference's ``beta`` values (0.04 for GenEval)
    weigh this quantity.

    ``mean``, ``ref_mean``: (B, ...); ``std``: the step's transition std, as for
    :func:`gaussian_mean_kl`; ``abs_dt``: ``|s' - s|``, a number or (B,). Returns (B,).
    """
    return gaussian_mean_kl(mean, ref_mean, std) * torch.as_tensor(abs_dt, dtype=torch.float32, device=mean.device).reshape(-1)


def step_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, *, definition: str = "exact",
            abs_dt: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample KL of one Gaussian step to the reference's, (B,): ``definition="exact"`` is
    :func:`gaussian_mean_kl` (the KL of the two transitions), ``"reference"`` is
    :func:`reference_code_kl` (needs ``abs_dt``)."""
    if definition == "exact":
        return gaussian_mean_kl(mean, ref_mean, std)
    if definition == "reference":
        if abs_dt is None:
            raise ValueError("the reference code's KL needs the step's |dt|")
        return reference_code_kl(mean, ref_mean, std, abs_dt)
    raise ValueError(f"definition must be one of {', '.join(KL_DEFINITIONS)}, got {definition!r}")
