"""Calling the reward during training: output checks, a worker thread, whole groups, non-finite rewards.

The reward protocol is ``images, prompts, metadata -> (B,)`` (:mod:`reward_models`).
:class:`RewardPool` scores a rollout's chunks as they are sampled: with ``reward.async`` on one
worker thread, so that chunk k is scored while chunk k+1 of the same iteration samples, else
before the next chunk samples; both give the same rewards (the same calls on the same inputs,
made in the same order). It hands each image's prompt group to the reward (``metadata["group"]``)
and, for a reward that compares the images of a group (``groupwise``, e.g. ``pairwise``), holds
chunks back until their groups are whole. Non-finite rewards are counted (``reward.nonfinite``:
stop, or leave them for masking).

A failed call does not stop the rollout where it happens: its future holds the error, the calls
after it are not made, and :func:`collect` hands the first error to :func:`agree_on_failure`, which
every process calls at the same point of an iteration. Under FSDP the rollout's forwards are
collectives and the rewards are gathered for the advantages, so a process that stopped alone would
leave the others waiting; instead every process learns of a failure on any of them there, and all
take the same stop path.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from diffalign import faults
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
            faults.reward_called()
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
    """A finished 'future' (the synchronous path)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class Failed:
    """A failed 'future' (the synchronous path): ``result()`` raises the call's error."""

    def __init__(self, error: RewardError):
        self.error = error

    def result(self):
        raise self.error


def collect(futures: Sequence) -> tuple[list[tuple[torch.Tensor, dict]], Optional[RewardError]]:
    """Wait for every reward call of a rollout: (the results of those that succeeded, in order; the
    first call's error where one failed, else None). Errors other than ``RewardError`` (defects)
    are raised."""
    results, error = [], None
    for future in futures:
        try:
            results.append(future.result())
        except RewardError as exc:
            error = error or exc
    return results, error


def agree_on_failure(error: Optional[RewardError], accelerator, device) -> None:
    """Raise on every process when the reward failed on any of them, else return (a collective:
    every process calls it at the same point, ``error`` being its own failure or None).

    One flag is summed over processes; only after a failure do the processes exchange their
    messages. The error raised is :class:`RewardFailures` when any process ran out of
    ``reward.max_failures`` (the run stops with a checkpoint), else the first process's
    ``RewardError``; its message names the process where the reward failed and it is marked
    ``agreed`` (raised by every process together: the command line prints it once)."""
    if accelerator.num_processes == 1:
        if error is not None:
            error.agreed = True
            raise error
        return
    flag = torch.tensor([0.0 if error is None else 1.0], device=device)
    if float(accelerator.reduce(flag, reduction="sum").item()) == 0:
        return
    from accelerate.utils import gather_object

    reports = gather_object([None if error is None else (isinstance(error, RewardFailures), str(error))])
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    give_up = any(exhausted for _, (exhausted, _) in failed)
    rank, (_, message) = next((r, rep) for r, rep in failed if rep[0] == give_up)
    also = [str(r) for r, _ in failed if r != rank]
    where = f"on process {rank}" + (f" (and {', '.join(also)})" if also else "")
    agreed = (RewardFailures if give_up else RewardError)(f"{message} {where}")
    agreed.agreed = True
    raise agreed


class Share:
    """One chunk's part of a reward call that scored several chunks at once (whole groups): rows
    ``rows`` of the call's rewards; the call's info goes to its first chunk only (so that
    :func:`reward_info` counts it once)."""

    def __init__(self, pool: "RewardPool"):
        self.pool = pool
        self.call = None  # the future of the call that scores this chunk, once its groups are whole
        self.rows = slice(0)
        self.first = False

    def result(self):
        if self.call is None:  # asked for before its groups were whole: the rollout is over
            self.pool.release(final=True)
        rewards, info = self.call.result()
        return rewards[self.rows], (info if self.first else {})


@dataclass
class _Held:
    """A chunk waiting for the rest of its groups."""

    images: torch.Tensor
    prompts: list[str]
    groups: torch.Tensor  # (B,) group id of each image
    group_size: int
    share: Share


class RewardPool:
    """Runs ``score(images, prompts, metadata) -> (rewards (B,), info)`` now or on one worker thread.

    ``asynchronous``: ``reward.async``. ``groupwise``: the reward compares the images of a group,
    so chunks are held back until each of their groups is whole and scored together. ``stats`` is
    the trainer's counter dict (``nonfinite_rewards`` is counted here)."""

    def __init__(self, score: Callable, *, asynchronous: bool, reward_name: str, nonfinite: str, stats: dict,
                 groupwise: bool = False):
        self.score = score
        self.asynchronous = asynchronous
        self.groupwise = groupwise
        self.reward_name = reward_name
        self.nonfinite = nonfinite
        self.stats = stats
        self.pool: Optional[ThreadPoolExecutor] = None
        self.held: list[_Held] = []
        self.failed = False  # a call on the worker failed: later queued calls are not made (as in the synchronous path)

    def submit(self, images: torch.Tensor, prompts: list[str], groups: Optional[torch.Tensor] = None,
               group_size: Optional[int] = None):
        """Score one chunk (``groups``: (B,) prompt-group id of each image, ``group_size`` images
        per group); returns a future-like object whose ``result()`` is (rewards (B,), info)."""
        images = images.cpu()  # the reward gets the same CPU images on either path and moves them to its device
        if not self.groupwise:
            return self._call(images, list(prompts), groups)
        if groups is None or group_size is None:
            raise RewardError(f"reward {self.reward_name!r} compares the images of a prompt group, but this rollout "
                              "passes no groups (see docs/rewards.md#pairwise-preference-rewards for the methods it runs with)")
        share = Share(self)
        self.held.append(_Held(images, list(prompts), groups.cpu(), int(group_size), share))
        self.release(final=False)
        return share

    def release(self, *, final: bool) -> None:
        """Score the longest run of held chunks whose groups are all whole (``final``: all of them,
        which must be whole: a group left incomplete at the end of a rollout is a caller's error)."""
        counts: Counter = Counter()
        end = 0
        for i, held in enumerate(self.held):
            counts.update(held.groups.tolist())
            if all(n >= held.group_size for n in counts.values()):
                end = i + 1
        if final and end < len(self.held):
            short = {g: n for g, n in counts.items() if n < self.held[0].group_size}
            raise ValueError(f"reward {self.reward_name!r}: groups {sorted(short)} ended with fewer images than their group size")
        if not end:
            return
        chunks, self.held = self.held[:end], self.held[end:]
        call = self._call(torch.cat([c.images for c in chunks]), [p for c in chunks for p in c.prompts],
                          torch.cat([c.groups for c in chunks]))
        start = 0
        for i, chunk in enumerate(chunks):
            n = len(chunk.prompts)
            chunk.share.call, chunk.share.rows, chunk.share.first = call, slice(start, start + n), i == 0
            start += n

    def _call(self, images: torch.Tensor, prompts: list[str], groups: Optional[torch.Tensor]):
        metadata = [{} for _ in prompts] if groups is None else [{"group": int(g)} for g in groups]
        if not self.asynchronous:
            try:
                return Done(self._scored(images, prompts, metadata))
            except RewardError as exc:
                return Failed(exc)
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        return self.pool.submit(self._scored, images, prompts, metadata)

    def _scored(self, images, prompts, metadata):
        """One call (on the worker thread with ``reward.async``). After a failure the later calls
        of the rollout are not made: a failure stops the run at the end of the rollout
        (:func:`agree_on_failure`), and calls made meanwhile would only count more failures
        (``reward.max_failures``)."""
        if self.failed:
            raise RewardFailures(f"reward {self.reward_name!r}: not scored after an earlier failed call")
        try:
            return self.score(images, prompts, metadata)
        except BaseException:
            self.failed = True
            raise

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
        """Wait for the worker thread and let it go (a later :meth:`submit` starts a new one); drop
        held chunks and forget a failure (a resumed or repeated iteration starts clean)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        self.held = []
        self.failed = False
