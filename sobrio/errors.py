"""Typed errors. The HTTP edge maps them to OpenAI error bodies; messages never quote user text."""

import traceback


class SobrioError(Exception):
    """Base of every error sobrio raises on purpose."""


class InvalidRequestError(SobrioError, ValueError):
    """The request is malformed or out of bounds (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnknownModelError(SobrioError, LookupError):
    """No model of that name is known or installed (HTTP 404)."""


class PermissionDeniedError(SobrioError):
    """The caller's tenant may not use this model, or no backend in its allowed regions serves it (HTTP 403)."""

    def __init__(self, message: str, param: str | None = None, code: str = "model_not_allowed"):
        super().__init__(message)
        self.param = param
        self.code = code


class EngineOverloadedError(SobrioError):
    """The waiting queue is full (HTTP 429)."""


class BudgetExceededError(SobrioError):
    """The request's worst case does not fit in what its tenant's budget has left (HTTP 429, Retry-After)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ConfigError(SobrioError, ValueError):
    """A configuration value is out of bounds; `option` is how the user named it (`--block-size`).

    A ValueError too, so callers that guarded `LLM(...)` or a config with `except ValueError` keep working.
    """

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


def where(exc: BaseException) -> str:
    """The innermost frame of an exception as `file:line in function`, without its message: what a log may
    say of an error on the request path (a message, or a traceback's, may quote request data)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"
