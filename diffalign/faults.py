"""Fault injection for the reliability tests: ``DIFFALIGN_FAULT`` makes a run fail on purpose.

Values (comma-separated):

- ``kill-after-write=N``: the process kills itself with SIGKILL right after its N-th durable file
  write (a metrics line, a checkpoint file, ``config.yaml``): a crash between two writes, at a
  point chosen by N, including in the middle of a checkpoint.
- ``sigterm-after-write=N`` / ``sigint-after-write=N``: the process sends itself SIGTERM / SIGINT
  after its N-th durable file write (a stop request arriving mid-run).
- ``enospc-in-checkpoint=K``: the K-th checkpoint of the process fails with
  ``OSError(ENOSPC)`` after its tensor file was written (a full disk halfway through).

Unset (the normal case), every hook is a dictionary lookup and nothing else.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

ENV = "DIFFALIGN_FAULT"
_counts = {"writes": 0, "checkpoints": 0}


def _spec() -> dict[str, int]:
    raw = os.environ.get(ENV, "")
    out = {}
    for part in filter(None, (p.strip() for p in raw.split(","))):
        name, _, value = part.partition("=")
        out[name] = int(value or 1)
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


def reset() -> None:
    """Restart the counters (tests that run several commands in one process)."""
    _counts.update(writes=0, checkpoints=0)
