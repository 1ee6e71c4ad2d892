"""Errors the trainer reports to the user as a clear message (and a non-zero exit) instead of a traceback."""


class TrainerError(RuntimeError):
    """Something in the setup the user has to fix: a missing file, an empty dataset, a bad reward function, ..."""


class ConfigError(ValueError):
    """A configuration the trainer cannot run: names the key, says what is expected."""
