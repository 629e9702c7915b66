"""Bounds on what one client can make the server hold: bytes, time, connections, sequences, tokens.

Each bound is a `sobrio serve` flag (`LimitsConfig` in sobrio/config/server.py, with its defaults) and
answers with an OpenAI error body. The cheap ones come first: the connection count and the body size are
checked before the body is parsed, the number of prompts and sequences before anything is tokenized, the
prompt tokens before anything is queued.

- `LimitsMiddleware` (ASGI): concurrent connections/requests (429 + Retry-After), body size (413, also
  for chunked bodies), body read time (408); the app then gets the body already read.
- `GuardedH11Protocol` (uvicorn's h11 protocol): a client that opened a connection must send a whole
  request head within `--header-timeout` (uvicorn has no such timeout: 200 half-sent requests would be
  held for good), and a refused body is discarded for at most `--body-timeout`.
- `check_fanout` and `check_prompt_tokens`: prompts, sequences and prompt tokens of one request.
"""

import asyncio
import json
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from sobrio.config import LimitsConfig
from sobrio.errors import EngineOverloadedError, InvalidRequestError, error_body, send_error

UNLIMITED_PATHS = ("/health", "/metrics")  # probes must see an overloaded server as alive


# ---- per request: prompts, sequences, tokens ----

def check_fanout(limits: LimitsConfig, num_prompts: int, n: int, waiting: int, max_waiting: int) -> None:
    """Refuse, before anything is tokenized, a request with too many prompts or sequences (400), or whose
    sequences do not fit in the waiting queue now (429)."""
    if num_prompts > limits.max_prompts_per_request:
        raise InvalidRequestError(f"{num_prompts} prompts in one request; the limit is "
                                  f"{limits.max_prompts_per_request}", param="prompt")
    seqs = num_prompts * n
    bound = min(limits.max_seqs_per_request, max_waiting)
    if seqs > bound:
        raise InvalidRequestError(f"{num_prompts} prompt(s) x n={n} is {seqs} sequences; one request may have "
                                  f"at most {bound}", param="n")
    if waiting + seqs > max_waiting:
        raise EngineOverloadedError(f"the waiting queue cannot take {seqs} more sequences now; retry later")


def check_prompt_tokens(limits: LimitsConfig, prompt_lengths: list[int], n: int) -> None:
    """Refuse, before anything is queued, a request whose prompt tokens x n exceed the limit (400)."""
    total = sum(prompt_lengths) * n
    if total > limits.max_request_tokens:
        raise InvalidRequestError(f"the request would queue {total} prompt tokens (prompt tokens x n); the limit "
                                  f"is {limits.max_request_tokens}", param="prompt")


# ---- ASGI: connections, body size, body time ----

class LimitsMiddleware:
    """Refuses work the server should not take (too many connections, a body too large or too slow) before
    any of it is parsed; passes the app a body already read, then the client's own receive (disconnects)."""

    def __init__(self, app, limits: LimitsConfig, count_connections: Callable[[], int] | None = None):
        self.app = app
        self.limits = limits
        self.count_connections = count_connections  # set by run_server: uvicorn's open connections
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        if self._overloaded():
            await send_error(send, 429, f"too many concurrent connections (limit {self.limits.limit_concurrency}); "
                             "retry later", "rate_limit_error", "too_many_connections", {"Retry-After": "1"})
            return
        self.in_flight += 1
        try:
            body = await self._read_body(scope, receive, send)
            if body is not None:
                await self.app(scope, _replay(body, receive), send)
        finally:
            self.in_flight -= 1

    def _overloaded(self) -> bool:
        connections = self.count_connections() if self.count_connections is not None else 0
        return max(self.in_flight + 1, connections) > self.limits.limit_concurrency

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None once answered (413, 408) or when the client has gone."""
        limit = self.limits.max_body_bytes
        if _content_length(scope) > limit:
            await _too_large(send, limit)
            return None
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        await _too_large(send, limit)
                        return None
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            await send_error(send, 408, f"the request body took longer than {self.limits.body_timeout:g} s",
                             "invalid_request_error", "request_timeout", close=True)
            return None


def _content_length(scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # h11 refuses these first; be safe anyway
                return 0
    return 0


async def _too_large(send, limit: int) -> None:
    # No "connection: close": uvicorn then discards the rest of the body (bounded by GuardedH11Protocol), so
    # the client can finish sending and read this answer instead of a reset connection.
    await send_error(send, 413, f"the request body is larger than {limit} bytes", "invalid_request_error",
                     "request_too_large")


def _replay(body: bytes, receive):
    """A receive that gives the body read already, then the client's own messages (its disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# ---- uvicorn protocol: header read time, refused-body discard time, JSON 400 ----

def _raw_error(status: int, message: str, code: str) -> bytes:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    head = (f"HTTP/1.1 {status} {STATUS_PHRASES[status].decode()}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline whenever the client owes bytes that no app is reading: a
    request head (`header_timeout`, from the connection's start or the first byte of the next request)
    or the rest of a body already refused (`discard_timeout`)."""

    header_timeout: float = LimitsConfig.header_timeout
    discard_timeout: float = LimitsConfig.body_timeout

    def connection_made(self, transport) -> None:
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _owed_timeout(self) -> float | None:
        their, ours = self.conn.their_state, self.conn.our_state
        if their is h11.IDLE and ours is h11.IDLE:
            return self.header_timeout
        if their is h11.SEND_BODY and ours in (h11.DONE, h11.MUST_CLOSE):
            return self.discard_timeout
        return None

    def _watch(self) -> None:
        timeout = None if self.transport.is_closing() else self._owed_timeout()
        if timeout is None:
            self._disarm()
        elif self._deadline is None:  # armed once: trickling bytes does not move the deadline
            self._deadline = self.loop.call_later(timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._owed_timeout() is None:
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:  # part of a head came
            self.transport.write(_raw_error(408, f"the request head took longer than {self.header_timeout:g} s",
                                            "request_timeout"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """A malformed request (or a head past h11's size limit): an OpenAI body instead of plain text."""
        self.transport.write(_raw_error(400, "invalid HTTP request", "invalid_http_request"))
        self.transport.close()


def protocol_class(limits: LimitsConfig) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": limits.header_timeout, "discard_timeout": limits.body_timeout})
