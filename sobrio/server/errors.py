"""OpenAI error bodies, for FastAPI handlers and for raw ASGI code, and logging that never quotes input.

An exception's message can quote what a user sent (a tokenizer error, a pydantic message, a key error
on a dict built from the body), so unexpected exceptions are logged by type and place only.
"""

import logging
import traceback

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from sobrio.errors import SobrioError, error_body, http_answer

logger = logging.getLogger("sobrio.server")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every non-2xx answer (OpenAI's shape)."""

    error: ErrorDetail


def error_response(status: int, message: str, err_type: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, param, code), status_code=status, headers=headers)


def sobrio_error_response(exc: SobrioError) -> JSONResponse:
    """A typed error's answer: its class says its status, OpenAI type, param, code and headers."""
    status, body, headers = http_answer(exc)
    return JSONResponse(body, status_code=status, headers=headers)


def where(exc: BaseException) -> str:
    """`file:line in function` of the innermost frame: enough to find the bug, no values."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    path = f.filename.replace("\\", "/")
    short = path.split("/sobrio/", 1)[1] if "/sobrio/" in path else "/".join(path.rsplit("/", 2)[-2:])
    return f"{short}:{f.lineno} in {f.name}"


def leaf_exceptions(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, which anyio task groups raise."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaf_exceptions(inner)]
    return [exc]


def log_unexpected(exc: BaseException, context: str) -> None:
    """Log an unexpected exception by type and place only: never its message, arguments or locals."""
    for leaf in leaf_exceptions(exc):
        logger.error("unexpected %s at %s (%s)", type(leaf).__name__, where(leaf), context)
