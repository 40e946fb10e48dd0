"""The one error posttrain raises for bad input: its message is one sentence that names the fix."""


class ConfigError(ValueError):
    """A setting, path, dataset or role configuration that cannot work; the message names the fix."""
