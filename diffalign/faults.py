"""Fault injection for the reliability tests: ``DIFFALIGN_FAULT`` makes a run fail on purpose.

Values (comma-separated):

- ``kill-after-write=N``: the process kills itself with SIGKILL right after its N-th durable file
  write (a metrics line, a checkpoint file, ``config.yaml``): a crash between two writes, at a
  point chosen by N, including in the middle of a checkpoint.
- ``sigterm-after-write=N`` / ``sigint-after-write=N``: the process sends itself SIGTERM / SIGINT
  after its N-th durable file write (a stop request arriving mid-run).
- ``enospc-in-checkpoint=K``: the K-th checkpoint of the process fails with
  ``OSError(ENOSPC)`` after its tensor file was written (a full disk halfway through).
- ``reward-down-at=K`` and ``reward-down-for=N`` (default 1): reward calls K to K + N - 1 of the
  process (counted from 1, retries included) fail with ``RewardError`` before the reward runs (a
  reward server that is down for a while).
- ``rank=R``: the faults apply on process R of a launch only (``RANK`` as torchrun and accelerate
  set it; 0 without a launcher); the other processes run clean.

Unset (the normal case), every hook is a dictionary lookup and nothing else.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

from diffalign.errors import RewardError

ENV = "DIFFALIGN_FAULT"
_counts = {"writes": 0, "checkpoints": 0, "reward_calls": 0}


def _spec() -> dict[str, int]:
    """The faults of this process ({} where ``rank`` names another one)."""
    raw = os.environ.get(ENV, "")
    out = {}
    for part in filter(None, (p.strip() for p in raw.split(","))):
        name, _, value = part.partition("=")
        out[name] = int(value or 1)
    if "rank" in out and out["rank"] != int(os.environ.get("RANK", "0")):
        return {}
    return out


def file_written(path: Path) -> None:
    """Called after each durable file write."""
    if ENV not in os.environ:
        return
    _counts["writes"] += 1
    spec = _spec()
    for name, signum in (("kill-after-write", signal.SIGKILL), ("sigterm-after-write", signal.SIGTERM),
                         ("sigint-after-write", signal.SIGINT)):
        if spec.get(name) == _counts["writes"]:
            os.kill(os.getpid(), signum)


def checkpoint_file_written(path: Path) -> None:
    """Called after a checkpoint's tensor file is written, before its ``state.json``."""
    if ENV not in os.environ:
        return
    _counts["checkpoints"] += 1
    if _spec().get("enospc-in-checkpoint") == _counts["checkpoints"]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def reward_called() -> None:
    """Called before each reward call (each attempt of ``call_with_retries``)."""
    if ENV not in os.environ:
        return
    _counts["reward_calls"] += 1
    spec = _spec()
    first = spec.get("reward-down-at")
    if first is not None and first <= _counts["reward_calls"] < first + spec.get("reward-down-for", 1):
        raise RewardError(f"reward call {_counts['reward_calls']} failed ({ENV}=reward-down-at={first})")


def reset() -> None:
    """Restart the counters (tests that run several commands in one process)."""
    _counts.update(writes=0, checkpoints=0, reward_calls=0)
