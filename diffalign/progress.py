"""Progress of long phases (evaluation, pair generation, reward-model training, export, pretraining).

On a terminal each phase shows a tqdm bar on stderr; elsewhere (a log file, a pipe, CI) the bar
is off and the phase prints one line when it starts, so logs stay short; ``--quiet`` (the CLI) or
:func:`set_quiet` silences both, and the CLI's ``--quiet`` also silences the libraries underneath
(:func:`silence_libraries`). No phase of a run is meant to stay silent on a terminal for more
than a few seconds: bars refresh at least every :data:`REFRESH_S` seconds.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterable, Optional

REFRESH_S = 1.0  # tqdm's mininterval: a bar redraws at most once a second
_quiet = False


def set_quiet(quiet: bool = True) -> None:
    """Silence progress bars and phase lines for the rest of the process (``--quiet``)."""
    global _quiet
    _quiet = bool(quiet)


# Environment read by the libraries when they import (and inherited by processes they start):
# tqdm's default for bars created without an explicit ``disable`` (diffusers' and transformers'
# loading and shard-writing bars), the Hub's download bars, and the two libraries' log levels.
_QUIET_ENV = {
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "DIFFUSERS_VERBOSITY": "error",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
# Modules whose Python warnings still show under --quiet: diffalign's own.
OWN_MODULES = r"(diffalign|reward_models|schedulers)(\.|$)"


def silence_libraries() -> None:
    """``--quiet`` for the libraries underneath: their warnings, info lines and progress bars off for
    the rest of the process, their errors kept. Importing diffusers, peft, transformers or accelerate
    probes every installed optional package and imports some (torchao, bitsandbytes, DeepSpeed),
    which log on import (failed shared objects, deprecations, "Setting accelerator to CPU"): levels set
    on their loggers beforehand do not hold, since torch and DeepSpeed reset them when they import,
    so logging is disabled below ERROR process-wide. diffalign writes its own lines with ``print``,
    and Python warnings of its own modules still show."""
    import importlib
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=OWN_MODULES)  # inserted first: wins over "ignore"
    for name, value in _QUIET_ENV.items():
        os.environ.setdefault(name, value)
    for library in ("diffusers", "transformers"):  # already imported (the Python API): the env came too late
        if library in sys.modules:
            hf_logging = importlib.import_module(f"{library}.utils.logging")
            hf_logging.disable_progress_bar()
            hf_logging.set_verbosity_error()


@contextlib.contextmanager
def library_loading_bars_off():
    """diffusers' and transformers' own progress bars off inside (a pipeline's "Loading pipeline
    components", a model's "Loading weights"), restored after: a run shows its own loading phase."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    restore = [lib for lib in (diffusers_logging, transformers_logging) if lib.is_progress_bar_enabled()]
    for lib in restore:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib in restore:
            lib.enable_progress_bar()


def is_quiet() -> bool:
    return _quiet


def interactive() -> bool:
    """Bars are drawn: not quiet and stderr is a terminal."""
    return not _quiet and sys.stderr.isatty()


def bar(iterable: Optional[Iterable] = None, *, total: Optional[int] = None, desc: str = "", unit: str = "it",
        disable: bool = False, leave: bool = False):
    """A tqdm bar on stderr when :func:`interactive`, else a silent pass-through (same interface).
    Off a terminal it prints ``desc ...`` once (see :func:`phase`) unless ``disable``. A drawn bar
    redraws every :data:`REFRESH_S` seconds even between updates, so that its elapsed time keeps
    moving through a long step."""
    draw = interactive() and not disable
    if not draw and not disable and desc:
        phase(f"{desc} ...")
    cls = _heartbeat_class()
    return cls(iterable, total=total, desc=desc, unit=unit, disable=not draw, leave=leave, file=sys.stderr,
               mininterval=REFRESH_S, dynamic_ncols=True)


_HEARTBEAT = None


def _heartbeat_class():
    """tqdm with a daemon thread that refreshes the bar every REFRESH_S seconds until it closes."""
    global _HEARTBEAT
    if _HEARTBEAT is None:
        import threading

        from tqdm.auto import tqdm

        class HeartbeatBar(tqdm):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self._stop = threading.Event()
                if not self.disable:
                    threading.Thread(target=self._beat, daemon=True).start()

            def _beat(self) -> None:
                while not self._stop.wait(REFRESH_S):
                    try:
                        self.refresh()
                    except Exception:  # closed meanwhile (interpreter shutdown, a torn-down stream)
                        return

            def close(self) -> None:
                if hasattr(self, "_stop"):
                    self._stop.set()
                super().close()

        _HEARTBEAT = HeartbeatBar
    return _HEARTBEAT


def phase(message: str) -> None:
    """One line on stderr (unless quiet), on the first process of a multi-process launch only
    (``RANK`` as torchrun and accelerate set it): a phase starts or ends."""
    if not _quiet and os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
