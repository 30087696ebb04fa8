"""ConfigError: the one error for a configuration that is malformed or asks for something unsupported, whichever
file it came from (a checkpoint's config.json, a serving YAML, a sweep YAML). Its message names the file, the key
and the reason. It lives in the engine, the lowest package, so that every layer raises the same class.
"""


class ConfigError(ValueError):
    """A configuration file or value is malformed or describes something pdserve does not support."""
