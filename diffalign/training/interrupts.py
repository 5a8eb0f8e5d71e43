"""Stopping a run cleanly on SIGINT / SIGTERM (Ctrl-C, or a scheduler such as Slurm ending a job).

:class:`StopSignals` turns the first signal into a flag that the training loop reads after each
iteration (the loop then writes a checkpoint and exits); a second Ctrl-C stops at once, as
Python's default does. :meth:`StopSignals.requested` agrees on the flag across processes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Optional

import torch


class StopSignals:
    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.signum: Optional[int] = None

    @contextlib.contextmanager
    def installed(self):
        """Handle SIGINT and SIGTERM inside the block (main thread only; elsewhere a no-op)."""
        self.signum = None
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def handler(signum, frame):
            if signum == signal.SIGINT and self.signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.signum = signum
            self.log(f"{signal.Signals(signum).name} received: finishing the iteration, then writing a checkpoint "
                     f"(Ctrl-C again stops at once)")

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def requested(self, accelerator, device) -> Optional[int]:
        """The signal that asked this run to stop, agreed by every process (a collective)."""
        signum = self.signum or 0
        if accelerator.num_processes > 1:
            flag = torch.tensor([signum], device=device)
            signum = int(accelerator.reduce(flag, reduction="max").item())
        return signum or None
