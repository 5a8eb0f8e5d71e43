"""OPD (on-policy distillation, DiffusionOPD): a student fitted to one or several frozen teachers
along its own rollouts, as pure tensor functions.

Paper: Li et al., "DiffusionOPD: A Unified Perspective of On-Policy Distillation in Diffusion
Models" (arXiv:2605.15055); reference code ali-vilab/DiffusionOPD (``scripts/train_sd3_opd.py``,
``config/opd.py``). The same per-step objective is verl-omni's ``distill_kl`` loss. See ``docs/opd.md``.

Intuition: on-policy distillation for language models scores every token the student sampled with
the teacher's log-probability. For a diffusion model every denoising step is a Gaussian transition
``p(x_{t'} | x_t) = N(mu(x_t), s_t^2 I)``; the student (mu_S) and a teacher (mu_T) evaluated at the
*student's* state ``x_t`` share the std, so their per-step KL is closed-form mean matching:

    KL(p_S || p_T) = ||mu_S - mu_T||^2 / (2 s_t^2)            (SDE rollouts)
                   -> 0.5 ||mu_S - mu_T||^2                   (ODE rollouts: no noise, plain MSE)

For an ODE (Euler) step ``mu = x + v dt``, so the ODE loss is ``0.5 dt^2 ||v_S - v_T||^2``: a
velocity MSE weighted by the squared step size. Per sample the squared difference is averaged over
latent elements and summed over the teachers routed to its prompt (each with a weight, 1 by
default); the loss is the mean over (sample, trained step) terms. The reference divides the SDE
branch by the kernel's ``sigma_t^2`` (Flow-GRPO's ``std_dev_t``, the step std without its
``sqrt(|dt|)``), i.e. the exact transition KL times ``|dt|``; callers pass that variance.

Routing: which teachers a prompt is distilled from. A teacher lists task labels (ShapesWorld
families) and / or regular expressions searched in the prompt text; a teacher with neither takes
every prompt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from diffalign.algorithms.flow_grpo import gaussian_mean_kl


def transition_kl(student_mean: torch.Tensor, teacher_mean: torch.Tensor, variance: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-sample mean-matching KL of one denoising step, (B,).

    Args:
        student_mean: (B, *latent) the student's transition mean at its own state (with grad).
        teacher_mean: (B, *latent) a teacher's transition mean at the same state (detached).
        variance: (B,) the divisor's variance per sample (SDE rollouts), or None for ODE rollouts,
            where the KL's ``1 / (2 s^2)`` becomes ``1 / 2`` (the reference's ``noise_level = 0`` branch).
    Returns ``mean_elements((mu_S - mu_T)^2) / (2 variance)`` or ``0.5 mean_elements((mu_S - mu_T)^2)``; math in fp32.
    """
    # the KL of two Gaussian steps with one std (flow_grpo.gaussian_mean_kl); ODE rollouts: std 1
    std = torch.ones((), device=student_mean.device) if variance is None else variance.float().reshape(-1).clamp_min(1e-8).sqrt()
    return gaussian_mean_kl(student_mean, teacher_mean.detach(), std)  # the reference's clamp of sigma^2 above


@dataclass
class OPDLossOutput:
    """One micro-batch of one denoising step. ``per_sample`` (B,) with grad; ``per_teacher`` (B, K)
    detached, zero where a teacher is not routed."""

    per_sample: torch.Tensor
    per_teacher: torch.Tensor


def opd_loss(student_mean: torch.Tensor, teacher_means: Sequence[Optional[torch.Tensor]], weights: torch.Tensor,
             variance: Optional[torch.Tensor] = None) -> OPDLossOutput:
    """The distillation loss of one step: ``sum_k w_bk KL(p_S || p_T_k)`` per sample.

    Args:
        student_mean: (B, *latent) student transition means (with grad).
        teacher_means: K entries, each (B, *latent) the k-th teacher's means at the same states, or
            None for a teacher routed to none of these samples (its weights must be 0 there).
        weights: (B, K) teacher weight per sample: the teacher's weight where it is routed, else 0.
        variance: as :func:`transition_kl`.
    """
    if weights.ndim != 2 or weights.shape != (student_mean.shape[0], len(teacher_means)):
        raise ValueError(f"weights must be (B, K) = ({student_mean.shape[0]}, {len(teacher_means)}), got {tuple(weights.shape)}")
    weights = weights.to(student_mean.device, torch.float32)
    terms = []
    for k, mean in enumerate(teacher_means):
        if mean is None:
            if bool((weights[:, k] != 0).any()):
                raise ValueError(f"teacher {k} is routed to some samples but has no means")
            terms.append(torch.zeros_like(weights[:, k]))
        else:
            terms.append(weights[:, k] * transition_kl(student_mean, mean, variance))
    per_teacher = torch.stack(terms, dim=1)
    return OPDLossOutput(per_teacher.sum(dim=1), per_teacher.detach())


@dataclass(frozen=True)
class Route:
    """Which prompts one teacher is given: those whose label is in ``labels`` or whose text matches
    one of ``patterns`` (``re.search``); both empty = every prompt."""

    labels: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()

    def takes(self, prompt: str, label: Optional[str]) -> bool:
        if not self.labels and not self.patterns:
            return True
        return (label is not None and label in self.labels) or any(re.search(p, prompt) for p in self.patterns)


def routing_weights(prompts: Sequence[str], labels: Sequence[Optional[str]], routes: Sequence[Route],
                    weights: Sequence[float]) -> torch.Tensor:
    """(B, K) fp32: ``weights[k]`` where teacher k takes prompt b (its route), else 0. ``labels``:
    each prompt's task label (its ShapesWorld family) or None."""
    if len(labels) != len(prompts) or len(weights) != len(routes):
        raise ValueError("one label per prompt and one weight per route")
    rows = [[float(w) if route.takes(p, lab) else 0.0 for route, w in zip(routes, weights)] for p, lab in zip(prompts, labels)]
    return torch.tensor(rows, dtype=torch.float32).reshape(len(prompts), len(routes))


__all__ = ["transition_kl", "OPDLossOutput", "opd_loss", "Route", "routing_weights"]
