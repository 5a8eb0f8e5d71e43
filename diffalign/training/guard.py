"""The reward-hacking guard: a verifier scores a run's own rollouts beside the learned reward, and a
divergence of the two curves warns, lowers the learning rate or stops the run (``train.guard``,
docs/reward_hacking.md).

A recipe hands the final images of its rollouts to :meth:`RewardGuard.observe` (through
``Trainer.guard_finals``) where they exist; after the iteration the trainer passes the
iteration's learned reward (its record's ``Trainer.learned_reward_key``) and the verifier's
scores summed over processes to :meth:`RewardGuard.close`, which appends one point to the two
curves, runs :func:`diffalign.trends.divergence` on the window and says what to do. The trainer
acts (the learning rate, the checkpoint, the stop); this part holds the curves and the counts,
and its state goes into checkpoints so that a resumed run continues the same window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

import reward_models
from diffalign.config import RewardGuardConfig
from diffalign.images import prompt_metadata
from diffalign.trends import Divergence, divergence


@dataclass
class GuardDecision:
    """What :meth:`RewardGuard.close` found at one scored iteration."""

    record: dict  # guard/* keys for metrics.jsonl
    test: Optional[Divergence] = None  # None while the window is not full
    action: str = ""  # "" (nothing to do), "warn", "lower_lr" or "stop"
    message: str = ""  # one line naming both trends (when diverged)


@dataclass
class RewardGuard:
    """Curves of the learned reward and the verifier at scored iterations, and the rule's verdicts.

    ``cfg``: ``train.guard`` (:class:`diffalign.config.RewardGuardConfig`); ``verifier``: the built
    reward (``images, prompts, metadata -> (B,)``); ``learned_key``: the iteration record's key of
    the learned reward (``reward_mean``, or a judge's score such as ``drm_score_mean``)."""

    cfg: RewardGuardConfig
    verifier: Callable
    learned_key: str
    iterations: list[int] = field(default_factory=list)
    learned: list[float] = field(default_factory=list)
    verified: list[float] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)  # standard error of each verifier mean (over its images)
    lr_drops: int = 0
    diverged: bool = False  # the last test diverged (a warning is logged when it starts)
    nonfinite: int = 0  # non-finite verifier scores and learned values seen (left out of the curves)
    _scores: list[torch.Tensor] = field(default_factory=list)  # this iteration's finite verifier scores

    # ---- during an iteration ------------------------------------------------------------------
    def scores_at(self, iteration: int) -> bool:
        """Whether the verifier scores this iteration (every ``train.guard.every``, from the first)."""
        return iteration % self.cfg.every == 0

    def begin(self) -> None:
        """Forget what an unfinished attempt at the iteration scored (a repeated iteration starts clean)."""
        self._scores = []

    def observe(self, images: torch.Tensor, prompts: list[str]) -> None:
        """Score final images ``(B, 3, H, W)`` (or videos) in [0, 1] with the verifier; keep the finite scores."""
        images = images.detach().float().cpu()
        value = reward_models.call_reward(self.verifier, images, prompts, prompt_metadata(prompts))
        scores = reward_models.check_reward_output(self.cfg.verifier, value, len(prompts)).detach().float().cpu()
        finite = torch.isfinite(scores)
        self.nonfinite += int((~finite).sum())
        self._scores.append(scores[finite])

    def local_sums(self) -> list[float]:
        """This process's ``[sum, sum of squares, count]`` of the iteration's verifier scores (the
        trainer sums them over processes)."""
        s = torch.cat(self._scores) if self._scores else torch.empty(0)
        return [float(s.double().sum()), float((s.double() ** 2).sum()), float(len(s))]

    # ---- after the iteration ------------------------------------------------------------------
    def close(self, iteration: int, learned: float, sums: list[float]) -> GuardDecision:
        """Append the iteration's point at x = ``iteration`` (the trainer passes iterations done) and
        test the window; ``sums``: :meth:`local_sums` summed over processes."""
        self._scores = []
        total, squares, n = sums
        mean = total / n if n > 0 else math.nan
        var = max(squares / n - mean * mean, 0.0) * n / (n - 1) if n > 1 else math.nan
        se = math.sqrt(var / n) if n > 1 else math.nan
        learned = float(learned) if learned is not None else math.nan
        if not math.isfinite(learned):
            self.nonfinite += 1
        record = {"guard/verifier": mean, "guard/learned": learned, "guard/verifier_images": int(n),
                  "guard/nonfinite": self.nonfinite}
        if math.isfinite(mean) and math.isfinite(learned):
            self.iterations.append(iteration)
            self.learned.append(learned)
            self.verified.append(mean)
            self.errors.append(se)
        test = divergence(self.iterations, self.learned, self.verified, window=self.cfg.window, min_drop=self.cfg.min_drop,
                          confidence=self.cfg.confidence, verifier_errors=self.errors)
        decision = GuardDecision(record, test)
        if test is None:
            return decision
        record.update({"guard/learned_slope": test.learned.slope, "guard/learned_slope_se": test.learned.se,
                       "guard/verifier_slope": test.verifier.slope, "guard/verifier_slope_se": test.verifier.se,
                       "guard/diverged": int(test.diverged)})
        started = test.diverged and not self.diverged
        self.diverged = test.diverged
        if not test.diverged:
            return decision
        decision.message = test.describe(f"the learned reward ({self.learned_key})", f"the verifier ({self.cfg.verifier})")
        action = self.cfg.action
        if action == "lower_lr" and self.lr_drops >= self.cfg.max_lr_drops:
            action = "warn"  # lowered as often as allowed: report only
        if action == "warn" and not started:
            return decision  # one warning per divergence, not one per iteration it lasts
        decision.action = action
        if action == "lower_lr":
            self.lr_drops += 1
            self.restart_window()  # the new rate earns a window of its own before it is judged
        return decision

    @property
    def lr_scale(self) -> float:
        """The factor the guard has put on the learning rate: ``lr_factor ** lr_drops``."""
        return self.cfg.lr_factor ** self.lr_drops

    def restart_window(self) -> None:
        for curve in (self.iterations, self.learned, self.verified, self.errors):
            curve.clear()
        self.diverged = False

    # ---- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-safe: a point's unknown standard error (one image) is stored as None."""
        return {"iterations": list(self.iterations), "learned": list(self.learned), "verified": list(self.verified),
                "errors": [e if math.isfinite(e) else None for e in self.errors], "lr_drops": self.lr_drops,
                "diverged": self.diverged, "nonfinite": self.nonfinite}

    def load_state_dict(self, state: dict) -> None:
        for key in ("iterations", "learned", "verified"):
            setattr(self, key, list(state[key]))
        self.errors = [math.nan if e is None else float(e) for e in state["errors"]]
        self.lr_drops, self.diverged, self.nonfinite = int(state["lr_drops"]), bool(state["diverged"]), int(state["nonfinite"])
