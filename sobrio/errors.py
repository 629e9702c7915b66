"""Typed errors, each carrying its HTTP status and OpenAI error type: the HTTP edge answers any of them
with one lookup (`http_answer`), whatever layer raised it. Messages never quote user text."""

import json
import traceback
from collections.abc import Awaitable, Callable


class SobrioError(Exception):
    """Base of every error sobrio raises on purpose. Unless a subclass says otherwise: 503, `server_error`."""

    status: int = 503
    error_type: str = "server_error"
    param: str | None = None
    code: str | None = None

    def headers(self) -> dict[str, str] | None:
        """Response headers the answer carries (Retry-After for a 429)."""
        return None


class InvalidRequestError(SobrioError, ValueError):
    """The request is malformed or out of bounds (HTTP 400)."""

    status, error_type = 400, "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnknownModelError(SobrioError, LookupError):
    """No model of that name is known or installed (HTTP 404)."""

    status, error_type, param, code = 404, "invalid_request_error", "model", "model_not_found"


class PermissionDeniedError(SobrioError):
    """The caller's tenant may not use this model, or no backend in its allowed regions serves it (HTTP 403)."""

    status, error_type = 403, "permission_error"

    def __init__(self, message: str, param: str | None = None, code: str = "model_not_allowed"):
        super().__init__(message)
        self.param = param
        self.code = code


class EngineOverloadedError(SobrioError):
    """The waiting queue is full (HTTP 429)."""

    status, error_type = 429, "rate_limit_error"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class BudgetExceededError(SobrioError):
    """The request's worst case does not fit in what its tenant's budget has left (HTTP 429, Retry-After)."""

    status, error_type, code = 429, "rate_limit_error", "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, self.retry_after))}


class EngineStepError(SobrioError):
    """The engine failed while computing this request (HTTP 500); other requests go on."""

    status = 500


class EngineUnavailableError(SobrioError):
    """The engine is restarting or stopping (HTTP 503)."""


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


def error_body(message: str, err_type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body: what every non-2xx answer of the server and the gateway carries."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def http_answer(exc: SobrioError) -> tuple[int, dict, dict[str, str] | None]:
    """Status, OpenAI body and headers of a typed error: a lookup of what the error class says of itself."""
    return exc.status, error_body(str(exc), exc.error_type, exc.param, exc.code), exc.headers()


Send = Callable[[dict], Awaitable[None]]


async def send_error(send: Send, status: int, message: str, err_type: str, code: str | None = None,
                     headers: dict[str, str] | None = None, close: bool = False) -> None:
    """Answer with an OpenAI error from raw ASGI code (middleware that runs before or outside FastAPI)."""
    body = json.dumps(error_body(message, err_type, None, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if close:  # the request body was not read to its end: the connection cannot carry another request
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})
