"""Diffusion-DPO: direct preference optimisation of a diffusion model on offline image pairs.

Paper: Wallace et al., "Diffusion Model Alignment Using Direct Preference Optimization" (CVPR
2024, arXiv:2311.12908); reference code github.com/SalesforceAIResearch/DiffusionDPO.

Intuition: DPO's implicit reward of an image is the log-likelihood ratio of policy and reference;
for a diffusion model the ELBO turns that ratio into a difference of denoising errors. Noise the
preferred image ``x_w`` and the rejected ``x_l`` with the **same** noise at the **same** t; the
policy should denoise ``x_w`` better than the reference does, relative to how it denoises ``x_l``:

    inside = -0.5 * beta * [(e_w - e_l) - (e_w^ref - e_l^ref)],     loss = -log sigmoid(inside)

with ``e = ||prediction - target||^2`` averaged over the latent dims (epsilon targets for
epsilon models; for flow models the velocity ``eps - x0``, the same objective written for
rectified flow). ``0.5 * beta`` is the reference code's scale (``beta_dpo`` 5000 for SD1.5 / SDXL
on Pick-a-Pic; the right value scales with the size of the per-sample errors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def per_sample_mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``mean((prediction - target)^2)`` over every non-batch dim: ``(B,)`` fp32."""
    err = (prediction.float() - target.float()) ** 2
    return err.mean(dim=tuple(range(1, err.ndim))) if err.ndim > 1 else err


@dataclass
class DPOLossOutput:
    """One micro-batch of ``B`` pairs.

    ``loss`` (with grad) is the mean of ``per_pair`` ``(B,)`` (with grad); ``inside`` ``(B,)`` is the
    logit ``-0.5 * beta * (model_diff - ref_diff)``; ``implicit_accuracy`` the fraction of pairs
    with ``inside > 0`` (the policy already prefers the winner more than the reference does);
    ``model_diff`` / ``ref_diff`` are the mean ``e_w - e_l`` of policy and reference (monitors: the
    policy's errors on both images drifting up together is DPO's known failure mode).
    """

    loss: torch.Tensor
    per_pair: torch.Tensor
    inside: torch.Tensor
    implicit_accuracy: torch.Tensor
    model_diff: torch.Tensor
    ref_diff: torch.Tensor


def diffusion_dpo_loss(
    model_err_win: torch.Tensor,
    model_err_lose: torch.Tensor,
    ref_err_win: torch.Tensor,
    ref_err_lose: torch.Tensor,
    *,
    beta: float,
) -> DPOLossOutput:
    """The Diffusion-DPO loss from per-sample denoising errors ``(B,)`` of policy and reference."""
    model_diff = model_err_win.float() - model_err_lose.float()
    ref_diff = (ref_err_win.float() - ref_err_lose.float()).detach()
    inside = -0.5 * beta * (model_diff - ref_diff)
    per_pair = -F.logsigmoid(inside)
    with torch.no_grad():
        acc = (inside > 0).float().mean()
    return DPOLossOutput(per_pair.mean(), per_pair, inside.detach(), acc, model_diff.detach().mean(), ref_diff.mean())
