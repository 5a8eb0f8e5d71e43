"""The clipped-surrogate update of one micro-batch of SDE transitions, shared by the recipes that
train with PPO's clipped ratio and an optional KL to the reference (Flow-GRPO and its variants,
BranchGRPO, DRM Step-GRPO), or with Flow-DPPO's KL trust-region mask in place of the clip
(Flow-GRPO's ``trust_region: kl_mask``). The math is :mod:`diffalign.algorithms.flow_grpo`."""

from __future__ import annotations

from typing import Callable

import torch

from diffalign.algorithms.flow_grpo import kl_mask_loss, ppo_clip_loss, step_kl

CLIP_STATS = ("loss", "policy_loss", "kl", "clip_frac", "approx_kl", "ratio_mean")  # logged per micro-batch


def reference_kl(trainer, x: torch.Tensor, t: torch.Tensor, embeds, guidance_scale: float, step,
                 rescore: Callable, *, step_times: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per-transition KL between the policy's Gaussian step ``step`` and the reference model's on
    the same transition: ``rescore(reference_output)`` re-scores it under the reference's output.

    ``step_times``: ``(t, t_next)`` of ``step``'s rows; the KL is the one ``algorithm.kl_definition``
    names (``exact``, or ``reference``: Flow-GRPO's code's, the exact one times ``|dt|``)."""
    with torch.no_grad(), trainer.reference_model(), trainer.autocast():
        ref_out = trainer.adapter.predict(x, t, embeds, guidance_scale)
    coarse = trainer.kernel.coarse  # the coordinates the step's density is over
    definition = trainer.algo.kl_definition
    abs_dt = trainer.kernel.abs_dt(*step_times) if definition == "reference" else None
    return step_kl(coarse(step.mean), coarse(rescore(ref_out).mean), step.std, definition=definition, abs_dt=abs_dt)


def accumulate_clipped(trainer, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                       kl, algo, terms: int, stats: dict[str, list[float]], *, policy_kl: torch.Tensor | None = None) -> bool:
    """PPO's clipped loss of one micro-batch (plus ``algo.beta`` x ``kl``), normalised by ``terms``
    (the optimizer step's transitions over all processes) and accumulated; the micro-batch's
    statistics are appended to ``stats``. False when the loss was non-finite (the step is poisoned).

    With ``policy_kl`` (B,), the KL of each old and current step (Flow-GRPO's ``trust_region:
    kl_mask``), Flow-DPPO's KL mask with ``algo.kl_mask_threshold`` replaces the clip."""
    if policy_kl is None:
        res = ppo_clip_loss(log_prob, old_log_prob, advantages, clip_range=algo.clip_range, kl=kl, beta=algo.beta)
    else:
        res = kl_mask_loss(log_prob, old_log_prob, advantages, policy_kl, threshold=algo.kl_mask_threshold, kl=kl, beta=algo.beta)
        stats.setdefault("policy_kl", []).append(float(policy_kl.detach().float().mean()))
    if not trainer.accumulate(res.per_sample.sum() / float(terms)):
        return False
    for key in CLIP_STATS:
        stats[key].append(float(getattr(res, key).detach()))
    return True
