"""The error types flame raises. A module of its own, importing nothing of flame's, so that
every module can raise them without importing the config machinery (no import cycles)."""


class ConfigError(ValueError):
    """A job setting that cannot work. The message is one line: what is wrong and what to change.

    Raised before any process group, dataset or model exists wherever the check allows it;
    ``flame.train`` and ``flame.launch`` print it as ``flame: error: ...`` and exit with 2.
    """


class NonFiniteGradientError(RuntimeError):
    """A step's gradient norm was NaN/Inf and --training.skip_nan_inf is off: the run stops, exit 1."""
