"""Sol-RL: contrastive seed selection and rank-fidelity measures, as pure tensor functions.

Paper: "Sol-RL" (NVIDIA, arXiv:2604.06916), reference code ``train_scripts/sol_rl`` of NVlabs/Sana.
Intuition: with a deterministic ODE sampler a seed fixes the image, so a cheap low-precision copy
of the policy can rank many seeds per prompt; only a contrastive subset of them (the best and the
worst) is regenerated at full precision and trained on. Whether the ranking transfers is measured
by the Kendall rank correlation and the top-k hit rate between the two stages' rewards.

Selection modes (``select_indices``), on the stage-1 rewards ``r`` (N,) of one prompt:

| mode              | picks                                                                  |
|-------------------|------------------------------------------------------------------------|
| ``best_worst``    | the ``k // 2`` highest and the ``k - k // 2`` lowest rewards (default)  |
| ``random``        | ``k`` uniformly at random (the control: no use of the ranking)        |
| ``mean_deviation``| the ``k`` largest ``|r - mean(r)|``                                    |
| ``extremes_random``| the argmax and the argmin, then ``k - 2`` at random from the rest     |

Ties are broken by position (a stable sort), never by chance, so the selection is a pure function
of the rewards and, for the random modes, of ``random_keys``. Unlike the reference code, which
silently clips ``k`` to the pool and can pick a seed twice under ties, ``k`` larger than the pool
is an error and the best and worst sets never overlap.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

SELECTION_MODES = ("best_worst", "random", "mean_deviation", "extremes_random")


def select_indices(rewards: torch.Tensor, k: int, mode: str = "best_worst", *, random_keys: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Indices (k,) of the seeds to regenerate, chosen from stage-1 ``rewards`` (N,).

    Args:
        rewards: (N,) finite stage-1 rewards of one prompt's pool.
        k: number of seeds to keep, ``1 <= k <= N``.
        mode: one of :data:`SELECTION_MODES`.
        random_keys: (N,) i.i.d. keys for the random modes (the k smallest keys are "random");
            drawn by the caller from its seeded generator so that the choice is reproducible.

    Returns a LongTensor of distinct indices: for ``best_worst`` the best first (descending),
    then the worst (ascending).
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D (one prompt's pool), got shape {tuple(rewards.shape)}")
    n = rewards.numel()
    if not 1 <= k <= n:
        raise ValueError(f"cannot select {k} seeds from a pool of {n}: need 1 <= k <= pool size")
    if mode not in SELECTION_MODES:
        raise ValueError(f"unknown selection mode {mode!r}; known: {', '.join(SELECTION_MODES)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("stage-1 rewards must be finite to rank the seeds")
    r = rewards.detach().float().cpu()
    if mode in ("random", "extremes_random"):
        if random_keys is None or random_keys.shape != r.shape:
            raise ValueError(f"mode {mode!r} needs random_keys of shape ({n},)")
        keys = random_keys.detach().float().cpu()
    if mode == "best_worst":
        order = torch.sort(r, descending=True, stable=True).indices  # best ... worst, ties in position order
        n_best = k // 2
        n_worst = k - n_best
        best = order[:n_best]
        worst = order[n - n_worst:].flip(0)  # the lowest first
        return torch.cat([best, worst])
    if mode == "random":
        return torch.sort(keys, stable=True).indices[:k]
    if mode == "mean_deviation":
        return torch.sort((r - r.mean()).abs(), descending=True, stable=True).indices[:k]
    # extremes_random
    hi = int(torch.sort(r, descending=True, stable=True).indices[0])
    lo = int(torch.sort(r, stable=True).indices[0])
    extremes = [hi] if hi == lo else [hi, lo]
    if k <= len(extremes):
        return torch.tensor(extremes[:k], dtype=torch.long)
    rest_mask = torch.ones(n, dtype=torch.bool)
    rest_mask[extremes] = False
    rest = torch.nonzero(rest_mask).flatten()
    picked = rest[torch.sort(keys[rest], stable=True).indices[: k - len(extremes)]]
    return torch.cat([torch.tensor(extremes, dtype=torch.long), picked])


def kendall_tau(x: torch.Tensor, y: torch.Tensor) -> float:
    """Kendall's tau-b between two score vectors of the same items (ties handled as tau-b).

    ``tau_b = (C - D) / sqrt((n0 - n1) (n0 - n2))`` with C / D the concordant / discordant
    pairs, ``n0 = n (n - 1) / 2``, ``n1`` / ``n2`` the pairs tied in x / in y. NaN when either
    vector is constant or has fewer than two items (the rank correlation is undefined).
    """
    x = torch.as_tensor(x).detach().double().flatten().cpu()
    y = torch.as_tensor(y).detach().double().flatten().cpu()
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same length, got {x.numel()} and {y.numel()}")
    n = x.numel()
    if n < 2:
        return float("nan")
    iu = torch.triu_indices(n, n, offset=1)
    dx = torch.sign(x[iu[0]] - x[iu[1]])
    dy = torch.sign(y[iu[0]] - y[iu[1]])
    s = float((dx * dy).sum())  # C - D (pairs tied in either vector contribute 0)
    n0 = n * (n - 1) / 2
    n1 = float((dx == 0).sum())
    n2 = float((dy == 0).sum())
    denom = math.sqrt((n0 - n1) * (n0 - n2))
    return s / denom if denom > 0 else float("nan")


def topk_hit_rate(proxy: torch.Tensor, target: torch.Tensor, k: int) -> float:
    """Fraction of the proxy's top-k that are also in the target's top-k.

    ``proxy``: scores used to choose (stage 1, low precision); ``target``: the scores that count
    (stage 2, full precision) of the same items. The proxy's top-k is taken with ties in position
    order (as :func:`select_indices`); an item counts as a hit when its target score is at least the
    k-th largest target score, so items tied with the target's k-th best are hits (with discrete
    rewards such as pass/fail the target top-k is otherwise ambiguous).
    """
    proxy = torch.as_tensor(proxy).detach().double().flatten().cpu()
    target = torch.as_tensor(target).detach().double().flatten().cpu()
    if proxy.shape != target.shape:
        raise ValueError(f"proxy and target must have the same length, got {proxy.numel()} and {target.numel()}")
    n = proxy.numel()
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    chosen = torch.sort(proxy, descending=True, stable=True).indices[:k]
    threshold = torch.sort(target, descending=True).values[k - 1]
    return float((target[chosen] >= threshold).sum()) / k


__all__ = ["SELECTION_MODES", "select_indices", "kendall_tau", "topk_hit_rate"]
