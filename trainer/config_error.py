"""The one error of a bad config value, with the offending key as data. A bottom module (no imports of the
trainer), so that the run config, the objective's config and the engines raise the same error, and a study
finds where it set a bad value from `error.key`, never from the message's text."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config value. `key`: the dotted path of the offending key in the run config (`train.lr`,
    `objective.beta`), or the option that held it (`--plan`); `message`: what is wrong, and the fix;
    `context`: where the config came from, when that is worth saying (`--run FILE DIR`).
    `str(error)` is `[context: ]key: message`."""

    def __init__(self, key: str, message: str, context: str | None = None) -> None:
        self.key, self.message, self.context = key, message, context
        super().__init__(f"{context}: {key}: {message}" if context else f"{key}: {message}")

    def at(self, context: str) -> "ConfigError":
        """The same error, said of the config that `context` names."""
        return ConfigError(self.key, self.message, context)

    def __reduce__(self):  # picklable across processes (a ValueError pickles its args alone)
        return type(self), (self.key, self.message, self.context)
