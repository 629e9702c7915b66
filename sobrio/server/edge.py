"""The HTTP edge around the FastAPI app, pure ASGI (no BaseHTTPMiddleware: it hides disconnects).

From the outside in: `HttpEdge` (X-Request-Id on every answer, one access-log line, no exception escapes
as plain text), CORS, `LimitsMiddleware`, the gateway's `TenantGate` (keys, tenants, their limits, the usage
ledger), then FastAPI.

Zero Data Retention by construction: what logs and the ledger hold of a URL is the template of the route it
matched (`/v1/models/{model_id:path}`), or `unknown`; never the path, the query or a header a client sent.
A client's own X-Request-Id is echoed (visible ASCII letters, digits and `-_.:`, 64 at most), never stored.
"""

import logging
import re
import time

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match

from sobrio.config import CorsConfig, LimitsConfig
from sobrio.errors import send_error
from sobrio.gateway.gate import TenantGate, header
from sobrio.gateway.ledger import Ledger
from sobrio.gateway.tenants import TenantStore
from sobrio.ids import new_id
from sobrio.server.errors import ErrorResponse, log_unexpected
from sobrio.server.limits import LimitsMiddleware

access_logger = logging.getLogger("sobrio.access")

_CLIENT_ID = re.compile(rb"[A-Za-z0-9_.:-]{1,64}")  # echoed as sent, never logged or stored
LOOPBACK_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def route_template(app: FastAPI, scope) -> str:
    """The path template of the route a request matches (a wrong method still names it), or "unknown"."""
    named = "unknown"
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route.path
        if match is Match.PARTIAL and named == "unknown":
            named = route.path
    return named


class HttpEdge:
    """Outermost layer. The answer's X-Request-Id is the client's (when sane) or the request's own id (the
    completion id the endpoint sets in `request.state.request_id`, else a fresh one). It names the request's
    route (`route_template`) in `state["route"]` for the layers inside it."""

    def __init__(self, app, routes: FastAPI):
        self.app = app
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        route = state["route"] = route_template(self.routes, scope)
        client_id = header(scope, b"x-request-id")
        client_id = client_id if client_id is not None and _CLIENT_ID.fullmatch(client_id) else None
        start, status = time.monotonic(), None

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                rid = client_id or str(state.get("request_id") or new_id("req")).encode()
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # noqa: BLE001 - the point: nothing escapes as a plain-text 500 or a traceback
            log_unexpected(exc, f"{_method(scope)} {route}")
            if status is None:
                await send_error(send_with_id, 500, "internal server error", "server_error")
        finally:
            access_logger.info("%s %s %s %.3fs", _method(scope), route, status or 499, time.monotonic() - start)


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"})


def _method(scope) -> str:
    """The request's method when it is a standard one ("OTHER": h11 lets any token through)."""
    return scope["method"] if scope["method"] in _METHODS else "OTHER"


def edge_stack(app: FastAPI, api_key: str | None, limits: LimitsConfig, cors: CorsConfig,
               store: TenantStore | None = None, ledger: Ledger | None = None, region: str = "WLD",
               metrics_require_key: bool = False) -> tuple[HttpEdge, LimitsMiddleware]:
    """The ASGI app to serve, and its limits layer (run_server gives it uvicorn's connection count). Without
    a tenant store the gateway's layer checks `--api-key` alone."""
    limited = LimitsMiddleware(TenantGate(app, api_key, store, ledger, region, metrics_require_key), limits)
    with_cors = CORSMiddleware(limited, allow_origins=cors.allowed_origins,
                               allow_origin_regex=None if cors.allowed_origins else LOOPBACK_ORIGINS,
                               allow_methods=cors.allowed_methods, allow_headers=cors.allowed_headers,
                               allow_credentials=cors.allow_credentials, expose_headers=["X-Request-Id"])
    return HttpEdge(with_cors, app), limited


# ---- OpenAPI: the errors the server really answers ----

_ERRORS = {"400": "Invalid request (a bad field is named in `param`)", "401": "Invalid or missing API key",
           "404": "Unknown model", "408": "Request body too slow", "413": "Request body too large",
           "429": "Waiting queue full or too many connections (see Retry-After)", "500": "Internal error"}


def install_openapi(app: FastAPI) -> None:
    """FastAPI documents a 422 for every body; sobrio answers 400 with an OpenAI error body instead."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            components["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, sub in components["ErrorResponse"].pop("$defs", {}).items():
                components[name] = sub
            error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
            for path, ops in schema.get("paths", {}).items():
                for op in ops.values():
                    op["responses"].pop("422", None)
                    if path.startswith("/v1"):
                        codes = _ERRORS if "requestBody" in op else {"401": _ERRORS["401"]}
                        op["responses"].update({c: {"description": d, **error} for c, d in codes.items()})
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
