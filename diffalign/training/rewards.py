"""Calling the reward during training: output checks, a worker thread, non-finite rewards.

The reward protocol is ``images, prompts, metadata -> (B,)`` (:mod:`reward_models`);
:class:`RewardPool` scores one batch while the next one is sampled (``rollout.overlap_rewards``)
and counts non-finite rewards (``reward.nonfinite``: stop, or leave them for masking).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from diffalign.errors import RewardError


class RewardFailures(RewardError):
    """More reward calls failed than ``reward.max_failures`` allows."""


def call_with_retries(call: Callable[[], object], reward_fn, stats: dict, max_failures: int,
                      log: Callable[[str], None]):
    """``call()`` (one reward call), made again after a failure (a server error, a malformed
    answer) until ``max_failures`` failures in the run; then :class:`RewardFailures`. Failures
    (``stats["reward_failures"]``) and the reward's own retries (``reward_fn.transient_retries``,
    where it counts them; ``stats["reward_retries"]``) are counted for the metrics."""
    while True:
        before = getattr(reward_fn, "transient_retries", 0)
        try:
            return call()
        except RewardError as exc:
            failures = stats["reward_failures"] = stats.get("reward_failures", 0) + 1
            if failures > max_failures:
                raise RewardFailures(f"{exc} ({failures} failed reward calls, reward.max_failures={max_failures})") from None
            log(f"warning: {exc}; scoring again (failure {failures} of reward.max_failures={max_failures})")
        finally:
            retried = getattr(reward_fn, "transient_retries", 0) - before
            if retried:
                stats["reward_retries"] = stats.get("reward_retries", 0) + retried


def reward_info(results: Sequence[tuple[torch.Tensor, dict]]) -> dict[str, float]:
    """Mean over batches of the reward's per-batch info (e.g. ShapesEval's per-family accuracy),
    keys prefixed ``reward/``. ``results`` are (rewards, info) pairs as the reward returns them."""
    info: dict[str, list[float]] = {}
    for _, batch_info in results:
        for k, v in batch_info.items():
            info.setdefault(k, []).append(float(v))
    return {(k if k.startswith("reward/") else f"reward/{k}"): float(np.mean(v)) for k, v in info.items()}


class Done:
    """A finished 'future' (used when reward overlap is off)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class RewardPool:
    """Runs ``score(images, prompts) -> (rewards (B,), info)`` now or on one worker thread.

    ``stats`` is the trainer's counter dict (``nonfinite_rewards`` is counted here)."""

    def __init__(self, score: Callable, *, overlap: bool, reward_name: str, nonfinite: str, stats: dict):
        self.score = score
        self.overlap = overlap
        self.reward_name = reward_name
        self.nonfinite = nonfinite
        self.stats = stats
        self.pool: Optional[ThreadPoolExecutor] = None

    def submit(self, images: torch.Tensor, prompts: list[str]):
        """Score on the worker thread (overlaps the next batch's sampling), or now when overlap is off."""
        if not self.overlap:
            return Done(self.score(images, prompts))
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        return self.pool.submit(self.score, images.cpu(), prompts)

    def check(self, rewards: torch.Tensor, iteration: int) -> torch.Tensor:
        """Count non-finite rewards; stop (``reward.nonfinite=error``) or leave them for masking."""
        bad = int((~torch.isfinite(rewards)).sum())
        if bad:
            self.stats["nonfinite_rewards"] += bad
            if self.nonfinite == "error":
                raise RewardError(
                    f"reward {self.reward_name!r} returned {bad} non-finite values (NaN/inf) of {len(rewards)} at iteration {iteration}"
                    " (set reward.nonfinite=skip to drop such samples)"
                )
        return rewards

    def shutdown(self) -> None:
        """Wait for the worker thread and let it go (a later :meth:`submit` starts a new one)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
