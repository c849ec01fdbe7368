"""The config tree's one error type, apart so that every section's module can raise it."""


class ConfigError(ValueError):
    """A bad config key or value; the message names the key and what is allowed."""
