"""Pairwise preference rewards (Pref-GRPO): each image's win rate against the other images of its group.

Pref-GRPO (2025) replaces absolute scores by preferences inside a group. Intuition: a reward model
that scores two nearly equal images 0.71 and 0.72 hands the group's z-scoring an illusory gap that
it blows up into a full advantage, which a policy learns to exploit. A pairwise judge only says
which of two images is better, and how sure it is; an image's reward is its **win rate**

    w_i = 1 / (G - 1) * sum_{j != i} p_ij,   p_ij = P(image i preferred over image j),  p_ji = 1 - p_ij

over the other G - 1 images of its prompt group, in [0, 1] (a tie counts 0.5 for each). The
advantages are the recipe's own group z-scores of the win rates (``algorithm.advantage_*``): no
recipe changes. Within a group the win rates always average 0.5.

A **pairwise judge** is a callable ``judge(images_a (P, 3, H, W), images_b (P, 3, H, W), prompts [P])
-> (P,)``: the probability that ``a`` is preferred (``output = "probability"``, the default) or a
preference logit (``output = "logit"``: ``p = sigmoid(logit)``). It is called once per unordered
pair of a group, ``G (G - 1) / 2`` judgements per group (``both_orders``: each pair also swapped,
``p_ij = (P(i over j) + 1 - P(j over i)) / 2``, against a judge's position bias, twice the calls).
A judge that compares through a pointwise score (``score(images, prompts) -> (B,)`` and
``prefer(score_a, score_b) -> (P,)``) is scored once per image instead.

Judges are found by name in :func:`register_judge`'s registry or by dotted path. Built in:
``bradley_terry`` (any pointwise reward r: ``p = sigmoid((r_a - r_b) / temperature)``, and with
``temperature: 0`` the hard comparison 1 / 0.5 / 0) and ``shapes_verifier`` (ShapesEval as a judge:
more of the prompt's requirements met wins, so passing beats failing; equal counts tie).

Group membership comes from ``metadata[i]["group"]`` (the trainer's reward pool hands whole groups,
see :mod:`diffalign.training.rewards`). Images without a group (an evaluation) get the judge's
pointwise score where it has one.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import torch

from diffalign.errors import RewardError
from reward_models.base import _resolve_dotted, build, check_reward_output, register


@runtime_checkable
class PairwiseJudge(Protocol):
    def __call__(self, images_a: torch.Tensor, images_b: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor: ...


_JUDGES: dict[str, Callable[..., PairwiseJudge]] = {}


def register_judge(name: str):
    """Class / factory decorator: ``@register_judge("my_vlm")``."""

    def deco(factory):
        if name in _JUDGES and _JUDGES[name] is not factory:
            raise ValueError(f"judge name {name!r} is registered twice")
        _JUDGES[name] = factory
        return factory

    return deco


def available_judges() -> list[str]:
    return sorted(_JUDGES)


def check_judge_name(name: Any) -> None:
    """The RewardError :func:`build_judge` raises for a name it cannot resolve, building nothing."""
    if not isinstance(name, str) or not name:
        raise RewardError(f"pairwise: judge must be a judge name, got {name!r}; known judges: {', '.join(available_judges())}")
    if name not in _JUDGES:
        if "." not in name and ":" not in name:
            raise RewardError(f"pairwise: unknown judge {name!r}; known judges: {', '.join(available_judges())}")
        _resolve_dotted(name)


def build_judge(name: str, **kwargs: Any) -> PairwiseJudge:
    """A judge by registered name or dotted path; ``kwargs`` go to its factory."""
    check_judge_name(name)
    factory = _JUDGES.get(name) or _resolve_dotted(name)
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise RewardError(f"pairwise: judge {name!r}: bad arguments {sorted(kwargs)}: {exc}") from None


# ---- the math -----------------------------------------------------------------------------------

def group_pairs(groups: Sequence[Any]) -> torch.Tensor:
    """(P, 2) long: every unordered pair ``(i, j)``, ``i < j``, of indices that share a group id."""
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    pairs = [(a, b) for idx in members.values() for k, a in enumerate(idx) for b in idx[k + 1:]]
    return torch.tensor(pairs, dtype=torch.long).view(-1, 2)


def win_rates(prob: torch.Tensor, pairs: torch.Tensor, n: int) -> torch.Tensor:
    """Each of ``n`` images' mean probability of winning its comparisons: ``prob`` (P,) is
    P(first of the pair preferred) for ``pairs`` (P, 2); the second wins with ``1 - prob``. An image
    in no pair (a group of one) gets 0.5; a non-finite ``prob`` makes both images' rates NaN.
    Returns float32 (n,)."""
    prob = prob.double()
    wins = torch.zeros(n, dtype=torch.float64).index_add_(0, pairs[:, 0], prob).index_add_(0, pairs[:, 1], 1.0 - prob)
    ones = torch.ones(len(pairs), dtype=torch.float64)
    counts = torch.zeros(n, dtype=torch.float64).index_add_(0, pairs[:, 0], ones).index_add_(0, pairs[:, 1], ones)
    return torch.where(counts > 0, wins / counts.clamp(min=1), torch.full_like(wins, 0.5)).float()


def preference_from_scores(score_a: torch.Tensor, score_b: torch.Tensor, temperature: float) -> torch.Tensor:
    """Bradley-Terry: ``sigmoid((s_a - s_b) / temperature)``; ``temperature = 0``: 1, 0.5 or 0 (the hard comparison)."""
    diff = score_a.double() - score_b.double()
    if temperature == 0:
        return torch.where(torch.isnan(diff), diff, 0.5 + 0.5 * torch.sign(diff)).float()
    return torch.sigmoid(diff / temperature).float()


# ---- the reward ---------------------------------------------------------------------------------

class PairwiseReward:
    """The reward ``pairwise``: win rates of a pairwise judge within each prompt group (module docstring).

    ``last_info``: ``pairwise/judgements`` (pairs judged in the call, swapped ones included),
    ``pairwise/ties`` (share of pairs judged exactly 0.5), for a score judge ``pairwise/score_mean``
    (its mean score: the win rates always average 0.5) and the judge's own ``last_info``."""

    groupwise = True  # the trainer's reward pool hands whole groups (reward_models.base.is_groupwise)

    def __init__(self, judge: PairwiseJudge, name: str, *, both_orders: bool = False, batch_size: int = 64):
        self.judge, self.name = judge, name
        self.both_orders = both_orders
        self.batch_size = batch_size
        self.last_info: dict[str, float] = {}

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        if len(metadata) != len(prompts) or len(prompts) != images.shape[0]:
            raise RewardError(f"pairwise: got {images.shape[0]} images, {len(prompts)} prompts and {len(metadata)} metadata dicts")
        groups = [(m or {}).get("group") for m in metadata]
        if all(g is None for g in groups):
            return self._pointwise(images, prompts)
        if any(g is None for g in groups):
            raise RewardError("pairwise: some images have a group (metadata 'group') and some do not")
        pairs = group_pairs(groups)
        for a, b in pairs.tolist():
            if prompts[a] != prompts[b]:
                raise RewardError(f"pairwise: group {groups[a]!r} mixes the prompts {prompts[a]!r} and {prompts[b]!r}")
        self._score_mean = None
        prob = self._judge_pairs(images, list(prompts), pairs)
        bad = torch.isfinite(prob) & ((prob < 0) | (prob > 1))
        if bad.any():
            raise RewardError(f"pairwise: judge {self.name!r} returned probabilities outside [0, 1] "
                              f"(e.g. {float(prob[bad][0]):.4g}); a judge that returns logits sets output = 'logit'")
        info = dict(getattr(self.judge, "last_info", None) or {})
        info["pairwise/judgements"] = float(len(pairs) * (2 if self.both_orders and not _scores(self.judge) else 1))
        info["pairwise/ties"] = float((prob == 0.5).float().mean()) if len(pairs) else math.nan
        if self._score_mean is not None:  # a score judge: the mean score, which the win rates (mean 0.5) do not show
            info["pairwise/score_mean"] = self._score_mean
        self.last_info = info
        return win_rates(prob, pairs, len(prompts))

    def _judge_pairs(self, images: torch.Tensor, prompts: list[str], pairs: torch.Tensor) -> torch.Tensor:
        """P(first of each pair preferred), (P,) float32."""
        if _scores(self.judge):  # one score per image, then the comparisons
            scores = check_reward_output(f"pairwise judge {self.name}", self.judge.score(images, prompts), len(prompts))
            self._score_mean = float(scores[torch.isfinite(scores)].mean()) if torch.isfinite(scores).any() else math.nan
            return self.judge.prefer(scores[pairs[:, 0]], scores[pairs[:, 1]]).float()
        prob = self._call_judge(images, prompts, pairs[:, 0], pairs[:, 1])
        if self.both_orders:
            prob = 0.5 * (prob + 1.0 - self._call_judge(images, prompts, pairs[:, 1], pairs[:, 0]))
        return prob

    def _call_judge(self, images: torch.Tensor, prompts: list[str], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = []
        for start in range(0, len(a), self.batch_size):
            ia, ib = a[start:start + self.batch_size], b[start:start + self.batch_size]
            value = self.judge(images[ia], images[ib], [prompts[i] for i in ia.tolist()])
            out.append(check_reward_output(f"pairwise judge {self.name}", value, len(ia)))
        prob = torch.cat(out) if out else torch.empty(0)
        return torch.sigmoid(prob) if getattr(self.judge, "output", "probability") == "logit" else prob

    def _pointwise(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        if not _scores(self.judge):
            raise RewardError(f"pairwise: images without a group (metadata 'group') need a judge with a pointwise score; "
                              f"judge {self.name!r} has none")
        scores = self.judge.score(images, list(prompts))
        self.last_info = dict(getattr(self.judge, "last_info", None) or {})
        return scores


def _scores(judge) -> bool:
    return callable(getattr(judge, "score", None)) and callable(getattr(judge, "prefer", None))


@register("pairwise")
def pairwise(judge: str, judge_kwargs: Optional[dict] = None, both_orders: bool = False, batch_size: int = 64,
             device: str | torch.device | None = None) -> PairwiseReward:
    """``reward.name: pairwise`` with ``reward.kwargs: {judge: NAME, judge_kwargs: {...}}``; ``device``
    goes to the judge unless its kwargs set one; ``batch_size``: pairs per judge call."""
    if judge_kwargs is not None and not isinstance(judge_kwargs, dict):
        raise RewardError(f"pairwise: judge_kwargs must be a mapping, got {type(judge_kwargs).__name__}")
    if not isinstance(both_orders, bool):
        raise RewardError(f"pairwise: both_orders must be true or false, got {both_orders!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise RewardError(f"pairwise: batch_size must be a positive integer, got {batch_size!r}")
    kwargs = dict(judge_kwargs or {})
    if device is not None:
        kwargs.setdefault("device", device)
    return PairwiseReward(build_judge(judge, **kwargs), judge, both_orders=both_orders, batch_size=batch_size)


# ---- judges -------------------------------------------------------------------------------------

@register_judge("bradley_terry")
class BradleyTerry:
    """A pairwise judge from any pointwise reward r (registered name or dotted path):
    ``P(a over b) = sigmoid((r(a) - r(b)) / temperature)``; ``temperature = 0``: the hard comparison
    (1 if r(a) > r(b), 0.5 on a tie, else 0). ``temperature`` is in the reward's units: the score gap
    at which the judge is 73 % sure. Scores each image once per call (``score`` / ``prefer``)."""

    def __init__(self, reward: str, reward_kwargs: Optional[dict] = None, temperature: float = 1.0,
                 device: str | torch.device | None = None):
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (math.isfinite(temperature) and temperature >= 0):
            raise RewardError(f"bradley_terry: temperature must be a finite number >= 0, got {temperature!r}")
        kwargs = dict(reward_kwargs or {})
        if device is not None:
            kwargs.setdefault("device", device)
        self.reward_name = reward
        self.reward = build(reward, **kwargs)
        self.temperature = float(temperature)
        self.last_info: dict[str, float] = {}

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """The pointwise reward (B,) float32; its ``last_info`` is kept as the judge's."""
        value = self.reward(images, list(prompts), [{} for _ in prompts])
        scores = check_reward_output(self.reward_name, value, len(prompts))
        self.last_info = dict(getattr(self.reward, "last_info", None) or {})
        return scores

    def prefer(self, score_a: torch.Tensor, score_b: torch.Tensor) -> torch.Tensor:
        return preference_from_scores(score_a, score_b, self.temperature)

    def __call__(self, images_a: torch.Tensor, images_b: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        scores = self.score(torch.cat([images_a, images_b]), list(prompts) * 2)
        return self.prefer(scores[: len(prompts)], scores[len(prompts):])


@register_judge("shapes_verifier")
def shapes_verifier(partial_credit: bool = True, device: str | torch.device | None = None) -> BradleyTerry:
    """ShapesEval as a judge: the image that meets more of the prompt's requirements wins (a pass
    meets them all, so it beats any fail), equal counts tie at 0.5; ``partial_credit: false``
    compares pass / fail only. A hard comparison (``bradley_terry`` with ``temperature: 0``)."""
    return BradleyTerry("shapes_eval", {"partial_credit": bool(partial_credit)}, temperature=0.0, device=device)
