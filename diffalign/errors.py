"""User-facing errors.

Anything a user can cause by bad input (config, paths, names, data) raises a subclass of
:class:`DiffalignError` with a one-line message that names the offending field or file.
The CLI turns these into ``error: <message>`` on stderr and exit code 2.
"""


class DiffalignError(Exception):
    """Base class for errors caused by user input. Message is one line and names the culprit.

    ``agreed``: raised by every process of a multi-process run together, after they agreed to stop
    (the message is true on each); the CLI prints it on the main process only."""

    agreed = False


class ConfigError(DiffalignError):
    """A config file or override is missing, malformed, has unknown keys or invalid values."""


class ModelLoadError(DiffalignError):
    """A model id, path or family cannot be resolved or loaded."""


class RewardError(DiffalignError):
    """A reward is unknown, cannot be built, or returned bad values (NaN, wrong shape)."""


class RunDirError(DiffalignError):
    """An output / run directory is in a state that forbids the requested action."""


class NonFiniteError(DiffalignError):
    """Too many non-finite rewards or losses were seen; the run stops instead of propagating them."""


class GuardStop(DiffalignError):
    """The reward-hacking guard (``train.guard.action=stop``) saw the learned reward rise while its
    verifier fell; the run wrote a checkpoint and stopped. The message names both trends. Every
    process decides it from the same reduced scores, so every process raises it together."""

    agreed = True


class Interrupted(Exception):
    """Training stopped on SIGINT / SIGTERM after finishing its iteration and writing a checkpoint.
    ``exit_code`` is 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM). Every process
    raises it together (the stop request is agreed), so it is ``agreed`` as a DiffalignError is."""

    agreed = True

    def __init__(self, signum: int, iteration: int, run_dir: str, checkpoint: bool = True):
        import signal

        self.signum, self.iteration, self.run_dir = signum, iteration, run_dir
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        saved = f"checkpoint at iteration {iteration} written" if checkpoint else "no iteration finished, nothing to save"
        super().__init__(f"stopped by {name}: {saved}; continue with: diffalign resume {run_dir}")


def close_match(name: object, known) -> str:
    """`` (did you mean 'x'?)`` with the entry of ``known`` closest to a misspelt ``name``, or ``""``
    when none is close (difflib's ratio below 0.6): the tail of an unknown-name message."""
    import difflib

    match = difflib.get_close_matches(str(name), [str(k) for k in known], n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""
