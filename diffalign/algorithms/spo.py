"""SPO: step-aware preference optimisation — pair selection and the losses, as pure tensor functions.

Paper: Liang et al., "Step-aware Preference Optimization: Aligning Preference with Denoising
Performance at Each Step" (2024, arXiv:2406.04314); reference code github.com/RockeyCoss/SPO.

Intuition: preference methods that label a whole trajectory by its final image assume every
denoising step shares that image's preference order. SPO judges each step on its own. From a
shared state ``x_t`` the step-wise resampler draws ``k`` candidates of ``x_{t-1}``; a
*step-aware preference model* (SPM) scores each candidate's x0 prediction at its noise level;
the best and the worst candidate form a (win, lose) pair for that one transition when the SPM is
confident enough; sampling then continues from a random candidate so the next pair is again a
comparison of two steps from one state. The policy is pushed towards the winning transition
with a DPO-style loss on clamped likelihood ratios against a frozen reference.

Symbols (code name -> paper): ``scores`` -> SPM outputs ``s``; ``margin`` ->
``softmax(s_w, s_l)[0] - softmax(s_w, s_l)[1]``; ``threshold`` -> the margin threshold (0.3 SD1.5,
0.4 SDXL); ``beta`` -> beta (10); ``clip_range`` -> epsilon of the ratio clamp (0.1).

All functions work on plain tensors; nothing here knows about models or devices.
"""

from __future__ import annotations

from dataclasses import dataclass


import torch
import torch.nn.functional as F



# --------------------------------------------------------------------------------------------
# The SPM's training objective (pairs noised with the same noise at the same t)
# --------------------------------------------------------------------------------------------


def spm_pair_loss(score_0: torch.Tensor, score_1: torch.Tensor, label_0: torch.Tensor) -> torch.Tensor:
    """Pair cross-entropy of a preference model, per pair ``(B,)`` fp32.

    ``p = softmax([s_0, s_1])``; ``loss = -(l_0 log p_0 + (1 - l_0) log p_1)`` with ``l_0`` the
    Pick-a-Pic label of image 0: 1 (image 0 preferred), 0 (image 1 preferred) or 0.5 (tie: the
    loss is minimal when the two scores are equal). PickScore and the reference SPM add
    ``log 0.5`` on ties so that the ideal loss is 0; that constant does not change gradients and
    is left out.
    """
    logits = torch.stack([score_0.float(), score_1.float()], dim=-1)
    logp = F.log_softmax(logits, dim=-1)
    label_0 = label_0.to(logp)
    return -(label_0 * logp[..., 0] + (1.0 - label_0) * logp[..., 1])


def pair_accuracy(score_0: torch.Tensor, score_1: torch.Tensor, label_0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(correct, decided)``, both ``(B,)``: ``decided`` marks pairs with a strict label (ties
    have no right answer and are excluded, as in the reference evaluation); ``correct`` is 1 where
    the higher score belongs to the preferred image (a score tie counts as wrong)."""
    decided = label_0 != 0.5
    prefers_0 = score_0 > score_1
    prefers_1 = score_1 > score_0
    correct = torch.where(label_0 == 1, prefers_0, prefers_1) & decided
    return correct.float(), decided


# --------------------------------------------------------------------------------------------
# Step-wise resampler: which candidates form the pair, which one continues
# --------------------------------------------------------------------------------------------


@dataclass
class PairSelection:
    """Choice among the ``k`` candidates of each of ``B`` states.

    ``best`` / ``worst``: ``(B,)`` long candidate indices; ``margin``: ``(B,)`` fp32
    ``softmax(s_best, s_worst)[0] - [1] = tanh((s_best - s_worst) / 2)`` in ``[0, 1)``;
    ``keep``: ``(B,)`` bool, ``margin > threshold`` (and best != worst).
    """

    best: torch.Tensor
    worst: torch.Tensor
    margin: torch.Tensor
    keep: torch.Tensor


def select_pairs(scores: torch.Tensor, threshold: float) -> PairSelection:
    """The (best, worst) candidate of each row of ``scores`` ``(B, k)``, kept when the SPM's
    two-way softmax margin exceeds ``threshold`` (the reference's ``preference_score_compare``)."""
    if scores.ndim != 2 or scores.shape[1] < 2:
        raise ValueError(f"scores must have shape (B, k >= 2), got {tuple(scores.shape)}")
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold must be in [0, 1), got {threshold!r}")
    s = scores.float()
    best = s.argmax(dim=1)
    worst = s.argmin(dim=1)
    rows = torch.arange(s.shape[0], device=s.device)
    pair = torch.stack([s[rows, best], s[rows, worst]], dim=1).softmax(dim=1)
    margin = pair[:, 0] - pair[:, 1]
    keep = (margin > threshold) & (best != worst)
    return PairSelection(best, worst, margin, keep)


# --------------------------------------------------------------------------------------------
# The SPO loss
# --------------------------------------------------------------------------------------------


@dataclass
class SPOLossOutput:
    """One micro-batch of ``B`` kept pairs.

    ``loss`` (with grad) is the mean of ``per_pair`` ``(B,)`` (with grad, for normalising by a
    global pair count across processes); ``ratio_win`` / ``ratio_lose`` are the clamped ratios
    ``(B,)``; ``clip_frac`` the fraction of ratios (win and lose together) that hit the clamp;
    ``accuracy`` the fraction of pairs with ``log r_w > log r_l`` (implicit preference accuracy).
    """

    loss: torch.Tensor
    per_pair: torch.Tensor
    ratio_win: torch.Tensor
    ratio_lose: torch.Tensor
    clip_frac: torch.Tensor
    accuracy: torch.Tensor


def spo_loss(
    log_prob_win: torch.Tensor,
    ref_log_prob_win: torch.Tensor,
    log_prob_lose: torch.Tensor,
    ref_log_prob_lose: torch.Tensor,
    *,
    beta: float = 10.0,
    clip_range: float = 0.1,
) -> SPOLossOutput:
    """``-log sigmoid(beta * log r_w - beta * log r_l)`` per pair.

    ``r = clamp(exp(logp_theta - logp_ref), 1 - eps, 1 + eps)`` with ``logp`` the log-density of
    the pair's transition ``x_t -> x_{t-1}`` under the policy and under the frozen reference (the
    initial weights). All inputs ``(B,)``; computed in fp32. Where a ratio sits on the clamp its
    gradient is zero, so the policy stops moving a transition once it is ``1 +- eps`` away from
    the reference — the trust region of SPO (exactly the reference code's expression).
    """
    lw = log_prob_win.float() - ref_log_prob_win.float()
    ll = log_prob_lose.float() - ref_log_prob_lose.float()
    ratio_w = torch.clamp(torch.exp(lw), 1.0 - clip_range, 1.0 + clip_range)
    ratio_l = torch.clamp(torch.exp(ll), 1.0 - clip_range, 1.0 + clip_range)
    logits = beta * (torch.log(ratio_w) - torch.log(ratio_l))
    per_pair = -F.logsigmoid(logits)
    with torch.no_grad():
        clipped = torch.cat([(lw.exp() - 1).abs() > clip_range, (ll.exp() - 1).abs() > clip_range]).float().mean()
        accuracy = (logits > 0).float().mean()
    return SPOLossOutput(per_pair.mean(), per_pair, ratio_w.detach(), ratio_l.detach(), clipped, accuracy)
