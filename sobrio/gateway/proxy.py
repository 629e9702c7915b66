"""Forwarding a chat or completion request to a remote OpenAI-compatible backend, and its answer back.

The request was checked here first (the same pydantic models as a local one); the body goes on with the
backend's own name for the model, the tenant's prefix-cache salt where the backend takes one, and, for a
stream, `include_usage` (the ledger needs the token counts; the usage chunk reaches the client only if it
asked). The answer comes back with the model named as the client asked.

A failure before the answer's first byte (a refused or broken connection, a 5xx) raises `BackendFailed`,
and the caller tries another replica once; a stream counts as started at its first event. What the
backend sends never reaches a log; the ledger gets its token counts and an energy estimate from them.
"""

import json
import time
from collections.abc import AsyncIterator

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sobrio.errors import SobrioError, error_body
from sobrio.gateway.backends import RemoteReplica
from sobrio.gateway.carbon import grams_co2
from sobrio.gateway.ledger import LedgerEntry


class BackendError(SobrioError):
    """A remote backend's failure, answered as `server_error` with a gateway status (502, 504)."""


class BackendFailed(BackendError):
    """The backend failed before its answer began: another replica may take the request (502 if none)."""

    status = 502


class BackendTimeout(BackendError):
    """The backend did not answer within its timeout (504); not retried, the request may still be running."""

    status = 504


def payload_for(replica: RemoteReplica, body: dict, salt: str | None, stream: bool) -> dict:
    """The body the backend gets: its model name, the salt where it takes one, usage in the stream."""
    payload = {k: v for k, v in body.items() if k != "cache_salt"}
    payload["model"] = replica.spec.model
    if salt is not None and replica.spec.sends_cache_salt:
        payload["cache_salt"] = salt
    if stream:
        payload["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return payload


async def forward(replica: RemoteReplica, endpoint: str, payload: dict, model_name: str,
                  entry: LedgerEntry | None, client_wants_usage: bool) -> Response:
    """The backend's answer as this server's (see the module's docstring for failures)."""
    if entry is not None:
        entry.backend = replica.name
    replica.in_flight += 1
    if not payload.get("stream"):
        try:
            return await _complete(replica, endpoint, payload, model_name, entry)
        finally:
            replica.in_flight -= 1
    try:
        response = await _open_stream(replica, endpoint, payload)
        opened = await _first_event(replica, response)
    except BaseException:
        replica.in_flight -= 1
        raise
    if isinstance(opened, Response):  # an error answer before any event
        replica.in_flight -= 1
        return opened
    events = _relay(replica, response, *opened, model_name, entry, client_wants_usage)
    return StreamingResponse(events, media_type="text/event-stream")


async def _complete(replica: RemoteReplica, endpoint: str, payload: dict, model_name: str,
                    entry: LedgerEntry | None) -> Response:
    try:
        response = await replica.client.post(endpoint, json=payload, headers=replica.headers)
    except httpx.TimeoutException:
        raise _timed_out(replica) from None
    except httpx.TransportError as exc:
        raise _failed(replica, exc) from None
    if response.status_code >= 500:
        raise BackendFailed(f"backend {replica.name} answered {response.status_code}")
    try:
        data = response.json()
    except ValueError:
        raise BackendFailed(f"backend {replica.name} answered with a body that is not JSON") from None
    if response.status_code >= 400:
        return _refused(replica, response.status_code, data, response.headers)
    data["model"] = model_name
    _note(replica, entry, data.get("usage"))
    return JSONResponse(data)


async def _open_stream(replica: RemoteReplica, endpoint: str, payload: dict) -> httpx.Response:
    client = replica.client
    request = client.build_request("POST", endpoint, json=payload, headers=replica.headers)
    try:
        response = await client.send(request, stream=True)
    except httpx.TimeoutException:
        raise _timed_out(replica) from None
    except httpx.TransportError as exc:
        raise _failed(replica, exc) from None
    if response.status_code >= 500:
        await response.aclose()
        raise BackendFailed(f"backend {replica.name} answered {response.status_code}")
    return response


async def _first_event(replica: RemoteReplica, response: httpx.Response) -> tuple[str, AsyncIterator[str]] | Response:
    """The stream's first `data:` payload and the lines after it; or, for a 4xx, the backend's refusal as
    this server's answer. The response is closed unless its lines are handed on."""
    handed_on = False
    try:
        if response.status_code >= 400:
            try:
                data = json.loads(await response.aread())
            except ValueError:
                data = {}
            return _refused(replica, response.status_code, data, response.headers)
        lines = response.aiter_lines()
        first = await _next_data(lines)
        if first is None:
            raise BackendFailed(f"backend {replica.name} ended its stream without an event")
        handed_on = True
        return first, lines
    except httpx.TimeoutException:
        raise _timed_out(replica) from None
    except httpx.TransportError as exc:
        raise _failed(replica, exc) from None
    finally:
        if not handed_on:
            await response.aclose()


async def _relay(replica: RemoteReplica, response: httpx.Response, first: str, lines: AsyncIterator[str],
                 model_name: str, entry: LedgerEntry | None, client_wants_usage: bool) -> AsyncIterator[str]:
    """The backend's events, renamed; a break mid-stream ends with an OpenAI error event, then [DONE]."""
    try:
        data = first
        while data is not None and data != "[DONE]":
            chunk = json.loads(data)
            out = _relayed(chunk, model_name, entry, replica, client_wants_usage)
            if out is not None:
                yield f"data: {json.dumps(out)}\n\n"
            data = await _next_data(lines)
    except (httpx.TransportError, ValueError) as exc:
        if entry is not None:
            entry.status = 502
        if isinstance(exc, httpx.TransportError):
            replica.mark(False, f"stream broke off ({type(exc).__name__})")
        message = f"backend {replica.name}'s stream broke off"
        yield f"data: {json.dumps(error_body(message, 'server_error'))}\n\n"
    finally:
        replica.in_flight -= 1
        await response.aclose()
    yield "data: [DONE]\n\n"


async def _next_data(lines) -> str | None:
    async for line in lines:
        if line.startswith("data:"):
            return line[5:].strip()
    return None


def _relayed(chunk: dict, model_name: str, entry: LedgerEntry | None, replica: RemoteReplica,
             client_wants_usage: bool) -> dict | None:
    """One event as the client gets it (None: the usage chunk it did not ask for)."""
    if "error" in chunk:
        if entry is not None:
            entry.status = 502
        return chunk
    if entry is not None and entry.ttft_s is None and chunk.get("choices"):
        entry.ttft_s = time.time() - entry.created_at
    usage = chunk.get("usage")
    if usage:
        _note(replica, entry, usage)
    if not client_wants_usage:
        if usage and not chunk.get("choices"):
            return None
        chunk.pop("usage", None)
    chunk["model"] = model_name
    return chunk


def _note(replica: RemoteReplica, entry: LedgerEntry | None, usage: dict | None) -> None:
    """Token counts into the ledger row, and the energy estimated from them (the backend's factors)."""
    if entry is None or not usage:
        return
    entry.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    entry.completion_tokens = int(usage.get("completion_tokens") or 0)
    entry.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    spec = replica.spec
    entry.energy_j = (entry.prompt_tokens * spec.joules_per_prompt_token
                      + entry.completion_tokens * spec.joules_per_output_token)
    entry.energy_source = "estimate"
    entry.co2_g = grams_co2(entry.energy_j, replica.region)


def _refused(replica: RemoteReplica, status: int, data: dict, headers) -> Response:
    """A backend's 4xx: the client's own mistake passes through; the gateway's (its key) is a 502."""
    if status in (401, 403):
        return JSONResponse(error_body(f"backend {replica.name} refused this gateway's credentials",
                                       "server_error"), status_code=502)
    body = data if isinstance(data, dict) and "error" in data else error_body(
        f"backend {replica.name} refused the request ({status})", "invalid_request_error")
    extra = {"Retry-After": headers["retry-after"]} if status == 429 and "retry-after" in headers else None
    return JSONResponse(body, status_code=status, headers=extra)


def _timed_out(replica: RemoteReplica) -> BackendTimeout:
    return BackendTimeout(f"backend {replica.name} did not answer within {replica.spec.timeout_s:g}s")


def _failed(replica: RemoteReplica, exc: httpx.TransportError) -> BackendFailed:
    """A refused or broken connection takes the replica out until its health check passes."""
    replica.mark(False, f"connection failed ({type(exc).__name__})")
    return BackendFailed(f"backend {replica.name} could not be reached")
