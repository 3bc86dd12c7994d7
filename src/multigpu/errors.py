"""The one exception a reader's mistake raises, in a module that imports nothing, so that
every part of the package (the config, the models, the estimator) can raise it without
importing another."""


class ConfigError(ValueError):
    """A value that cannot work; the message says which and what to do."""
