"""Trends of per-iteration curves, and the reward-hacking guard's divergence test (pure numbers).

A run that trains on a learned reward (a DRM, an SPM, a differentiable proxy) can score its own
rollouts with a verifier beside it (``train.guard``, docs/reward_hacking.md). Reward hacking
shows as the two curves parting: the learned reward keeps rising while the verifier falls.
:func:`divergence` tests that on the last ``window`` points of both curves.

The rule
    Over the last W points (iterations where the verifier scored), fit a straight line to each
    curve by least squares: slope ``b`` (units per iteration) and its standard error ``se(b)``.
    With ``q`` the one-sided ``confidence`` quantile of Student's t with W - 2 degrees of
    freedom, the curves diverge when all three hold:

    - the learned reward rises: ``b_learned - q se(b_learned) > 0``;
    - the verifier falls: ``b_verifier + q se(b_verifier) < 0``;
    - by enough to matter: the verifier's fitted fall over the window,
      ``-b_verifier (x_last - x_first)``, is at least ``min_drop`` (the verifier's units).

Why a slope with its standard error
    One iteration's verifier score is a mean over its rollout's images (64 on ShapesWorld), so it
    moves by several hundredths from one iteration to the next with no change in the policy. A
    single drop, or a difference of two iterations, would fire on that noise; a slope over W
    points averages it, and its standard error says how much of the slope the scatter explains.
    The standard error is the larger of two estimates: the scatter of the points around the line
    (what the data show) and, where the caller knows each point's sampling error (the standard
    error of an iteration's mean over its images), the error those alone put on the slope. The
    second keeps a window whose few noisy points happen to line up from looking certain. Both
    curves must move with confidence: a learned reward that wanders while the verifier wanders
    the other way is not a divergence. ``min_drop`` keeps a tiny but steady decline (a long
    window makes one significant) from acting on a run.

All inputs are plain sequences; non-finite points are left out (and counted by the caller).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

MIN_WINDOW = 4  # a slope's standard error needs >= 2 degrees of freedom (W - 2) to mean anything


@dataclass(frozen=True)
class Trend:
    """A least-squares line through ``n`` points: slope (units per iteration) and its standard error."""

    slope: float
    se: float  # standard error of the slope
    n: int
    first: float  # the first and last x (iteration) of the points
    last: float

    @property
    def change(self) -> float:
        """The fitted change over the points' span: ``slope x (last - first)``."""
        return self.slope * (self.last - self.first)


def trend(xs: Sequence[float], ys: Sequence[float], errors: Optional[Sequence[float]] = None) -> Trend:
    """The least-squares slope of ``ys`` on ``xs`` (at least 3 points, at least 2 distinct x).

    ``se`` is the larger of the residual standard error ``sqrt(sum r^2 / (n - 2) / Sxx)`` and, when
    ``errors`` (each point's own standard error) is given, ``sqrt(mean(errors^2) / Sxx)`` over its
    finite entries (a point of one image has no standard error)."""
    n = len(xs)
    if n != len(ys) or (errors is not None and len(errors) != n):
        raise ValueError(f"trend: {n} x values, {len(ys)} y values" + ("" if errors is None else f", {len(errors)} errors"))
    if n < 3:
        raise ValueError(f"trend: needs at least 3 points, got {n}")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        raise ValueError("trend: all x values are equal")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    se = math.sqrt(residual / (n - 2) / sxx)
    known = [e for e in errors if math.isfinite(e)] if errors is not None else []
    if known:
        se = max(se, math.sqrt(sum(e * e for e in known) / len(known) / sxx))
    return Trend(slope, se, n, float(min(xs)), float(max(xs)))


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with integer ``df`` >= 1 (closed form, Abramowitz & Stegun 26.7.3-4)."""
    if df < 1:
        raise ValueError(f"t_cdf: df must be >= 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:
        term = total = 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        inside = s * total  # P(|T| <= |t|)
    else:
        term = total = math.cos(theta) if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        inside = 2 / math.pi * (theta + s * total)
    return 0.5 + math.copysign(inside / 2, t)


def t_quantile(p: float, df: int) -> float:
    """The one-sided quantile: the t with ``t_cdf(t, df) = p`` (``0.5 < p < 1``), by bisection."""
    if not 0.5 < p < 1:
        raise ValueError(f"t_quantile: p must be in (0.5, 1), got {p}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Divergence:
    """The test of :func:`divergence` on one window."""

    learned: Trend
    verifier: Trend
    critical: float  # q: the one-sided t quantile each slope's bound uses
    min_drop: float
    confidence: float

    @property
    def learned_rises(self) -> bool:
        return self.learned.slope - self.critical * self.learned.se > 0

    @property
    def verifier_falls(self) -> bool:
        return self.verifier.slope + self.critical * self.verifier.se < 0 and -self.verifier.change >= self.min_drop

    @property
    def diverged(self) -> bool:
        return self.learned_rises and self.verifier_falls

    def describe(self, learned_name: str = "learned reward", verifier_name: str = "verifier") -> str:
        """One line naming both trends, e.g. ``learned reward drm_score_mean rose +0.0210/iteration ...``."""
        ln, vn = self.learned, self.verifier
        return (f"{learned_name} rose {ln.slope:+.4f}/iteration (+- {ln.se:.4f}) while {verifier_name} fell "
                f"{vn.slope:+.4f}/iteration (+- {vn.se:.4f}; {vn.change:+.3f} over iterations {ln.first:.0f}-{ln.last:.0f}, "
                f"{ln.n} points, one-sided {self.confidence:.0%} bounds)")


def divergence(iterations: Sequence[float], learned: Sequence[float], verifier: Sequence[float], *, window: int,
               min_drop: float, confidence: float, verifier_errors: Optional[Sequence[float]] = None) -> Optional[Divergence]:
    """The divergence test (module docstring) on the last ``window`` points at which both curves are
    finite; None while fewer than ``window`` such points exist. ``verifier_errors``: each point's
    standard error of the verifier's mean (optional; non-finite ones are ignored, see :func:`trend`)."""
    if window < MIN_WINDOW:
        raise ValueError(f"divergence: window must be >= {MIN_WINDOW}, got {window}")
    errors = verifier_errors if verifier_errors is not None else [math.nan] * len(iterations)
    points = [(x, a, b, e) for x, a, b, e in zip(iterations, learned, verifier, errors)
              if math.isfinite(x) and math.isfinite(a) and math.isfinite(b)][-window:]
    if len(points) < window:
        return None
    xs = [p[0] for p in points]
    q = t_quantile(confidence, window - 2)
    return Divergence(trend(xs, [p[1] for p in points]), trend(xs, [p[2] for p in points], [p[3] for p in points]), q,
                      min_drop, confidence)
