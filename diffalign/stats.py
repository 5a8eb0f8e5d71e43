"""Intervals for evaluation metrics: a stratified bootstrap over prompts, and paired differences.

An evaluation is a list of per-image records, each a mapping with at least

    ``prompt`` (str), ``family`` (str), ``passed`` (bool), ``score`` (float, partial credit in [0, 1])

(:meth:`reward_models.shapes_eval.ShapesEval.evaluate` returns these keys). The metrics are

    ``acc/<family>``  share of a family's images that pass
    ``acc/overall``   mean of the family accuracies (GenEval's overall score: families weigh the
                      same however many prompts or images each has)
    ``acc/images``    share of all images that pass
    ``partial``       mean partial credit over all images

Where the noise comes from
    The evaluated prompts are a sample of what the model could be asked, and a prompt's images
    share its difficulty, so the unit of resampling is the prompt, not the image. The bootstrap
    draws, within each family, as many prompts as the family has, with replacement, and keeps
    each drawn prompt's images together (all of its records enter the resample). Resampling
    within families (stratification) keeps every family's number of prompts fixed, so the family
    mean that defines ``acc/overall`` always averages the same families, and with equal images per
    prompt every family keeps its number of images. Each metric is recomputed on every resample
    (ratios of sums, so prompts with more images weigh more); the interval is the percentile
    interval of those values (``level`` = 0.95: the 2.5th and 97.5th percentiles, linearly
    interpolated as :func:`numpy.quantile`'s default). The point estimate is the metric on the
    evaluation itself.

Paired comparison
    Two models sampled on the same prompt list with the same seed see the same initial noise
    image by image, so their outcomes are correlated: a prompt that is hard for one is usually
    hard for the other. :func:`paired_difference` applies the same prompt resample to both
    models and takes the percentile interval of the differences; the prompt difficulty that
    both share cancels, so the interval is narrower than one built from two independent
    intervals. A difference whose interval excludes 0 is marked outside noise
    (:attr:`Difference.outside_noise`).

Two independent samples
    :func:`bootstrap_mean_difference` compares the means of two unpaired samples of numbers (the
    report uses it for two windows of per-iteration training rewards): each sample is resampled
    with replacement on its own, and the interval is the percentile interval of the differences
    of the resampled means.

Limits
    A family with a single prompt gets a zero-width interval for its own accuracy: resampling
    prompts cannot see the variation between that prompt's images. Percentile intervals from few
    prompts (3 in the smallest family) are somewhat too narrow. Everything is seeded: the same
    records, ``resamples`` and ``seed`` give the same interval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

__all__ = [
    "DEFAULT_LEVEL",
    "DEFAULT_RESAMPLES",
    "DEFAULT_SEED",
    "Difference",
    "Interval",
    "bootstrap_intervals",
    "bootstrap_mean_difference",
    "bootstrap_replicates",
    "metric_keys",
    "paired_difference",
    "paired_replicates",
    "percentile_interval",
    "point_estimates",
]

DEFAULT_RESAMPLES = 2000
DEFAULT_SEED = 0
DEFAULT_LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap interval ``[lo, hi]``."""

    value: float
    lo: float
    hi: float

    @property
    def width(self) -> float:
        return self.hi - self.lo

    def format(self, digits: int = 3) -> str:
        """``0.198 [0.158, 0.243]``."""
        return f"{self.value:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"

    def to_dict(self) -> dict[str, float]:
        return {"value": self.value, "lo": self.lo, "hi": self.hi}


@dataclass(frozen=True)
class Difference(Interval):
    """A paired difference (second model minus first) with its paired bootstrap interval."""

    @property
    def outside_noise(self) -> bool:
        """True when 0 lies outside the interval (a gain or loss the resampling does not explain)."""
        return self.lo > 0 or self.hi < 0

    def format(self, digits: int = 3) -> str:
        """``+0.030 [+0.003, +0.061] *``; the ``*`` marks a difference outside noise."""
        text = f"{self.value:+.{digits}f} [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}]"
        return text + (" *" if self.outside_noise else "")

    def to_dict(self) -> dict:
        return {**super().to_dict(), "outside_noise": self.outside_noise}


# --------------------------------------------------------------------------------------------
# Records -> per-prompt sums, grouped by family
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Family:
    name: str
    prompts: tuple[str, ...]  # sorted
    images: np.ndarray  # (P,) images per prompt
    passed: np.ndarray  # (P,) passing images per prompt
    score: np.ndarray  # (P,) summed partial credit per prompt


def _strata(records: Sequence[Mapping]) -> list[_Family]:
    """Families in order of first appearance, each with its prompts' sums."""
    if not records:
        raise ValueError("no evaluation records")
    sums: dict[str, dict[str, list[float]]] = {}
    for i, r in enumerate(records):
        try:
            family, prompt, passed, score = r["family"], r["prompt"], r["passed"], r["score"]
        except KeyError as exc:
            raise ValueError(f"evaluation record {i} has no {exc.args[0]!r} key") from None
        acc = sums.setdefault(str(family), {}).setdefault(str(prompt), [0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += float(bool(passed))
        acc[2] += float(score)
    out = []
    for family, by_prompt in sums.items():
        prompts = tuple(sorted(by_prompt))
        arr = np.asarray([by_prompt[p] for p in prompts], dtype=np.float64)
        out.append(_Family(family, prompts, arr[:, 0], arr[:, 1], arr[:, 2]))
    return out


def metric_keys(records: Sequence[Mapping]) -> list[str]:
    """The metric names of these records: ``acc/<family>`` (order of first appearance),
    ``acc/overall``, ``acc/images``, ``partial``."""
    return [f"acc/{f.name}" for f in _strata(records)] + ["acc/overall", "acc/images", "partial"]


def _metrics(strata: Sequence[_Family], draws: Sequence[np.ndarray] | None) -> dict[str, np.ndarray]:
    """Every metric for each row of ``draws`` (per family: (B, P) prompt indices), or for the
    records themselves when ``draws`` is None (arrays of shape (1,))."""
    fam_acc, n_all, pass_all, score_all = [], 0.0, 0.0, 0.0
    out: dict[str, np.ndarray] = {}
    for k, fam in enumerate(strata):
        if draws is None:
            n, p, s = (np.atleast_1d(a.sum()) for a in (fam.images, fam.passed, fam.score))
        else:
            idx = draws[k]
            n, p, s = fam.images[idx].sum(axis=1), fam.passed[idx].sum(axis=1), fam.score[idx].sum(axis=1)
        out[f"acc/{fam.name}"] = p / n
        fam_acc.append(p / n)
        n_all, pass_all, score_all = n_all + n, pass_all + p, score_all + s
    out["acc/overall"] = np.mean(fam_acc, axis=0)
    out["acc/images"] = pass_all / n_all
    out["partial"] = score_all / n_all
    return out


def _draws(strata: Sequence[_Family], resamples: int, seed: int) -> list[np.ndarray]:
    """Per family, ``resamples`` draws of as many prompt indices as it has, with replacement."""
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    rng = np.random.default_rng(seed)
    return [rng.integers(0, len(f.prompts), size=(resamples, len(f.prompts))) for f in strata]


def percentile_interval(replicates: np.ndarray, level: float = DEFAULT_LEVEL) -> tuple[float, float]:
    """The ``level`` percentile interval of bootstrap replicates: the ``(1 - level) / 2`` and
    ``(1 + level) / 2`` quantiles, linearly interpolated between order statistics."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    lo, hi = np.quantile(np.asarray(replicates, dtype=np.float64), [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


# --------------------------------------------------------------------------------------------
# One model
# --------------------------------------------------------------------------------------------


def point_estimates(records: Sequence[Mapping]) -> dict[str, float]:
    """Every metric (see the module docstring) on the records themselves."""
    return {k: float(v[0]) for k, v in _metrics(_strata(records), None).items()}


def bootstrap_replicates(records: Sequence[Mapping], *, resamples: int = DEFAULT_RESAMPLES,
                         seed: int = DEFAULT_SEED) -> dict[str, np.ndarray]:
    """Every metric on each of ``resamples`` stratified prompt resamples: ``{metric: (resamples,)}``."""
    strata = _strata(records)
    return _metrics(strata, _draws(strata, resamples, seed))


def bootstrap_intervals(records: Sequence[Mapping], *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                        level: float = DEFAULT_LEVEL) -> dict[str, Interval]:
    """Every metric with its ``level`` stratified-bootstrap interval over prompts."""
    points = point_estimates(records)
    reps = bootstrap_replicates(records, resamples=resamples, seed=seed)
    return {k: Interval(points[k], *percentile_interval(reps[k], level)) for k in points}


# --------------------------------------------------------------------------------------------
# Two models on the same prompts and seeds
# --------------------------------------------------------------------------------------------


def _check_paired(a: Sequence[_Family], b: Sequence[_Family]) -> None:
    if [f.name for f in a] != [f.name for f in b]:
        raise ValueError(f"paired comparison needs the same families; got {[f.name for f in a]} and {[f.name for f in b]}")
    for fa, fb in zip(a, b):
        if fa.prompts != fb.prompts or not np.array_equal(fa.images, fb.images):
            raise ValueError(f"paired comparison needs the same prompts and images per prompt; family {fa.name!r} differs")


def paired_replicates(records_a: Sequence[Mapping], records_b: Sequence[Mapping], *, resamples: int = DEFAULT_RESAMPLES,
                      seed: int = DEFAULT_SEED) -> dict[str, np.ndarray]:
    """``metric(b) - metric(a)`` on each of ``resamples`` stratified prompt resamples, the same
    resample applied to both models."""
    sa, sb = _strata(records_a), _strata(records_b)
    _check_paired(sa, sb)
    draws = _draws(sa, resamples, seed)
    ma, mb = _metrics(sa, draws), _metrics(sb, draws)
    return {k: mb[k] - ma[k] for k in ma}


def paired_difference(records_a: Sequence[Mapping], records_b: Sequence[Mapping], *, resamples: int = DEFAULT_RESAMPLES,
                      seed: int = DEFAULT_SEED, level: float = DEFAULT_LEVEL) -> dict[str, Difference]:
    """Every metric's difference ``b - a`` with its paired ``level`` bootstrap interval.

    ``records_a`` and ``records_b`` must come from the same prompts with the same number of
    images per prompt (the same evaluation list and seed, so that image ``i`` of both models
    started from the same noise); a mismatch raises ValueError."""
    pa, pb = point_estimates(records_a), point_estimates(records_b)
    reps = paired_replicates(records_a, records_b, resamples=resamples, seed=seed)
    return {k: Difference(pb[k] - pa[k], *percentile_interval(reps[k], level)) for k in pa}


# --------------------------------------------------------------------------------------------
# Two independent samples of numbers
# --------------------------------------------------------------------------------------------


def bootstrap_mean_difference(a: Sequence[float], b: Sequence[float], *, resamples: int = DEFAULT_RESAMPLES,
                              seed: int = DEFAULT_SEED, level: float = DEFAULT_LEVEL) -> Difference:
    """``mean(b) - mean(a)`` of two independent samples, with the ``level`` percentile interval of
    the difference over ``resamples`` draws that resample ``a`` and ``b`` each with replacement.

    Values are treated as exchangeable within each sample; serially correlated values (a training
    curve) make the interval somewhat too narrow."""
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if xa.ndim != 1 or xb.ndim != 1 or not len(xa) or not len(xb):
        raise ValueError(f"two non-empty 1-D samples expected, got shapes {xa.shape} and {xb.shape}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    rng = np.random.default_rng(seed)
    ra = xa[rng.integers(0, len(xa), size=(resamples, len(xa)))].mean(axis=1)
    rb = xb[rng.integers(0, len(xb), size=(resamples, len(xb)))].mean(axis=1)
    return Difference(float(xb.mean() - xa.mean()), *percentile_interval(rb - ra, level))
