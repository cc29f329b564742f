"""Errors a user can act on. The CLI prints their message and exits non-zero, no traceback."""


class HpipeError(Exception):
    """Base class: something the user asked for cannot be done, and the message says why."""


class ModelSourceError(HpipeError):
    """The model name or path does not lead to a usable model."""


class UnsupportedModelError(HpipeError):
    """The model's architecture or one of its settings is not implemented."""


class InputError(HpipeError):
    """The request is malformed: too long for the context or the cache, bad unit range, ..."""


class StatusError(HpipeError):
    """An error a daemon answers with the gRPC status it names (``NOT_FOUND``, ``RESOURCE_EXHAUSTED``, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
