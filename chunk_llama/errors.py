"""Errors every layer may raise; this module imports nothing of chunk-llama's."""


class UsageError(ValueError):
    """A setting this machine cannot honour (a GPU where torch sees none): the commands print
    it as one line and exit with code 2."""
