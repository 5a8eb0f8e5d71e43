"""DRM Step-GRPO: step-level advantages from a reward model that scores noisy states.

Paper: the diffusion-based reward model (DRM) with Step-GRPO (see ``docs/algorithms.md``).
Intuition: a reward model whose backbone is a diffusion denoiser can score a *noisy* latent
``x_t`` directly. So at each reverse step, branch ``k`` SDE candidates ``x_{t'}^j`` from the
shared state ``x_t``, score each with the DRM (no decode, no rollout to the end), and z-score the
``k`` scores: the candidates of one state form the group, and the transition ``x_t -> x_{t'}^j``
is trained with Flow-GRPO's clipped loss and advantage ``A_j``.

The DRM itself is trained with the Bradley-Terry loss on preference pairs that are noised with
the same noise at the same random ``t`` (:func:`bradley_terry_loss`).

All functions are pure and work on plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


import torch
import torch.nn.functional as F



@dataclass
class CandidateAdvantages:
    """``advantages``: (M, k) fp32, 0 where not kept; ``keep``: (M, k) bool — False for every
    candidate of a state whose k scores are all equal (when filtering) or that has a non-finite
    score; ``zero_std_fraction``: fraction of states whose scores were all equal."""

    advantages: torch.Tensor
    keep: torch.Tensor
    zero_std_fraction: float


def candidate_advantages(
    scores: torch.Tensor,
    *,
    eps: float = 1e-4,
    clip: float = 5.0,
    filter_zero_std: bool = True,
    zero_std_tol: float = 1e-6,
) -> CandidateAdvantages:
    """Z-score within the k candidates of each state: ``A_j = (s_j - mean_k) / (std_k + eps)``.

    Args:
        scores: (M, k) DRM scores of the k candidates branched from each of M states, k >= 2.
        eps: added to the (population) std; clip: ``A`` is clipped to ``+-clip``.

    A state with any non-finite score is dropped whole (its group statistics are undefined).
    """
    if scores.ndim != 2 or scores.shape[1] < 2:
        raise ValueError(f"scores must have shape (M, k) with k >= 2, got {tuple(scores.shape)}")
    s = scores.float()
    finite = torch.isfinite(s).all(dim=1, keepdim=True)  # (M, 1)
    safe = torch.where(finite, s, torch.zeros_like(s))
    mean = safe.mean(dim=1, keepdim=True)
    std = safe.std(dim=1, unbiased=False, keepdim=True)
    zero = std <= zero_std_tol
    adv = ((safe - mean) / (std + eps)).clamp(-clip, clip)
    keep = finite & ~zero if filter_zero_std else finite.clone()
    keep = keep.expand_as(s).clone()
    adv = torch.where(keep, adv, torch.zeros_like(adv))
    zero_frac = float((zero & finite).float().mean()) if len(s) else 0.0
    return CandidateAdvantages(adv, keep, zero_frac)


def bradley_terry_loss(score_0: torch.Tensor, score_1: torch.Tensor, label_0: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry loss of a batch of pairs, mean over pairs (scalar, with grad).

    ``P(0 preferred) = sigmoid(s_0 - s_1)``; ``label_0`` is 1 when image 0 is preferred, 0 when
    image 1 is, and 0.5 for a tie (Pick-a-Pic's convention), so the loss is the binary cross-
    entropy ``-(y log sigmoid(d) + (1 - y) log sigmoid(-d))`` with ``d = s_0 - s_1``; for hard
    labels it is ``-log sigmoid(s_w - s_l)``.
    """
    d = score_0.float() - score_1.float()
    return F.binary_cross_entropy_with_logits(d, label_0.float().to(d.device))


def pairwise_accuracy(score_0: torch.Tensor, score_1: torch.Tensor, label_0: torch.Tensor) -> tuple[float, int]:
    """(fraction of non-tied pairs ranked correctly, number of non-tied pairs). Equal scores count
    as half right, so a constant model scores 0.5."""
    label = label_0.float().cpu()
    d = (score_0.float() - score_1.float()).detach().cpu()
    decided = label != 0.5
    if not decided.any():
        return float("nan"), 0
    want = label[decided] > 0.5
    right = torch.where(d[decided] == 0, torch.full_like(d[decided], 0.5), ((d[decided] > 0) == want).float())
    return float(right.mean()), int(decided.sum())
