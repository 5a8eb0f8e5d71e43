"""User-facing errors.

Anything a user can cause by bad input (config, paths, names, data) raises a subclass of
:class:`DiffalignError` with a one-line message that names the offending field or file.
The CLI turns these into ``error: <message>`` on stderr and exit code 2.
"""


class DiffalignError(Exception):
    """Base class for errors caused by user input. Message is one line and names the culprit."""


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
