"""The HTTP edge against a real server: abandoned work stops, every input is bounded, errors are OpenAI bodies.

One small server for the module, with small limits so each one is cheap to hit.
"""

import asyncio
import json
import socket
import time

import httpx
import pytest

from tests.server.conftest import SMALL, serving, wait_until

SMOL = "smollm2-135m"
KEY = "k-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://ui.example"
CANARY = "CANARY-limits-5b1e"


@pytest.fixture(scope="module")
def srv():
    with serving(*SMALL, "--api-key", KEY, "--log-level", "trace", "--max-num-seqs", "2", "--max-num-waiting", "12",
                 "--max-body-bytes", str(64 << 10), "--max-prompts-per-request", "8", "--max-seqs-per-request", "16",
                 "--max-request-tokens", "2000", "--header-timeout", "2", "--body-timeout", "2",
                 "--limit-concurrency", "64", "--default-max-tokens", "24",
                 "--allowed-origins", json.dumps([ORIGIN])) as srv:
        yield srv


def _post(srv, path: str, timeout: float = 60, **kwargs) -> httpx.Response:
    headers = {**AUTH, **kwargs.pop("headers", {})}
    return httpx.post(f"{srv.base_url}{path}", timeout=timeout, headers=headers, **kwargs)


def _error(resp: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert code is None or error["code"] == code
    assert param is None or error["param"] == param
    return error


def _idle(srv) -> bool:
    return srv.metric("num_requests_running", SMOL) == 0 and srv.metric("num_requests_waiting", SMOL) == 0 \
        and srv.metric("kv_cache_usage_perc", SMOL) == 0


def test_non_streamed_client_timeout_frees_the_request(srv):
    """A client that gives up on a non-streamed request: the engine stops within a step or so, not after
    the 400 tokens (about 15 s here before the fix)."""
    body = {"model": SMOL, "prompt": "Tell a very long story.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        _post(srv, "/v1/completions", json=body, timeout=1.0)
    assert wait_until(lambda: _idle(srv), timeout=3.0), "the abandoned request is still running"


def test_body_size_is_bounded_before_parsing(srv):
    big = {"model": SMOL, "prompt": "x" * (70 << 10)}
    _error(_post(srv, "/v1/completions", json=big), 413, "request_too_large")
    chunked = (b"{" + b"x" * 4096 for _ in range(40))  # 160 kB, not even JSON: refused for its size alone
    _error(_post(srv, "/v1/completions", content=chunked, headers={"content-type": "application/json"}), 413,
           "request_too_large")
    ok = _post(srv, "/v1/completions", json={"model": SMOL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_prompts_sequences_and_tokens_per_request(srv):
    base = {"model": SMOL, "max_tokens": 2}
    _error(_post(srv, "/v1/completions", json={**base, "prompt": ["a"] * 9}), 400, param="prompt")
    _error(_post(srv, "/v1/completions", json={**base, "prompt": ["a"] * 4, "n": 4}), 400, param="n")
    error = _error(_post(srv, "/v1/completions", json={**base, "prompt": "hi " * 300, "n": 8}), 400, param="prompt")
    assert "prompt tokens x n" in error["message"]
    assert _post(srv, "/v1/completions", json={**base, "prompt": ["a"] * 4, "n": 3}).status_code == 200


def test_sequences_that_do_not_fit_the_waiting_queue_get_429(srv):
    """8 long prompts: 2 run, 6 wait; 8 more cannot fit in a queue of 12, so 429 at once."""
    long = {"model": SMOL, "prompt": [f"Story {i}:" for i in range(8)], "max_tokens": 300, "ignore_eos": True}

    async def scenario() -> tuple[httpx.Response, float]:
        async with httpx.AsyncClient(base_url=srv.base_url, headers=AUTH, timeout=60) as client:
            filler = asyncio.create_task(client.post("/v1/completions", json=long))
            try:
                assert await asyncio.to_thread(wait_until, lambda: srv.metric("num_requests_waiting", SMOL) >= 6, 10)
                started = time.monotonic()
                resp = await client.post("/v1/completions", json={**long, "max_tokens": 2})
                return resp, time.monotonic() - started
            finally:
                filler.cancel()  # hangs up: the server aborts the filler's sequences
                await asyncio.gather(filler, return_exceptions=True)

    resp, seconds = asyncio.run(scenario())
    _error(resp, 429)
    assert resp.headers["retry-after"] and seconds < 5
    assert wait_until(lambda: _idle(srv), timeout=5.0)


def _half_sent(srv, n: int) -> list[socket.socket]:
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", srv.port))
        if i % 2:  # half of them send part of a head, the others nothing at all
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    return socks


def test_half_sent_requests_are_timed_out_and_connections_bounded(srv):
    socks = _half_sent(srv, 200)
    try:
        refused = httpx.get(f"{srv.base_url}/v1/models", headers=AUTH)  # 201 connections > 64
        _error(refused, 429, "too_many_connections")
        assert refused.headers["retry-after"]
        assert httpx.get(f"{srv.base_url}/health").status_code == 200  # probes are never refused
        for i, s in enumerate(socks):  # each is closed by the server, with a 408 when part of a head came
            s.settimeout(10)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            assert data.startswith(b"HTTP/1.1 408") if i % 2 else data == b"", data[:80]
    finally:
        for s in socks:
            s.close()
    assert wait_until(lambda: httpx.get(f"{srv.base_url}/v1/models", headers=AUTH).status_code == 200, timeout=5)


def test_slow_body_gets_408(srv):
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
        s.settimeout(10)
        started, data = time.monotonic(), b""
        while chunk := s.recv(4096):
            data += chunk
    assert data.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in data, data[:200]
    assert 1.5 < time.monotonic() - started < 8


def test_chat_default_max_tokens_capped_at_the_context(srv):
    chat = {"model": SMOL, "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    resp = _post(srv, "/v1/chat/completions", json=chat).json()
    assert resp["usage"]["completion_tokens"] == 24 and resp["choices"][0]["finish_reason"] == "length"
    overhead = resp["usage"]["prompt_tokens"] - 1
    long = {**chat, "messages": [{"role": "user", "content": "Hi" + " hi" * (500 - overhead)}]}
    usage = _post(srv, "/v1/chat/completions", json=long).json()["usage"]
    assert 512 - 24 < usage["prompt_tokens"] < 512  # leaves less room than the default
    assert usage["completion_tokens"] == 512 - usage["prompt_tokens"]


def test_cors_preflight_and_auth(srv):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    ok = httpx.options(f"{srv.base_url}/v1/chat/completions", headers=preflight)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{srv.base_url}/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert other.status_code != 401 and "access-control-allow-origin" not in other.headers
    assert httpx.options(f"{srv.base_url}/v1/completions").status_code not in (401, 500)
    listed = httpx.get(f"{srv.base_url}/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert listed.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in listed.headers["access-control-expose-headers"].lower()
    _error(httpx.get(f"{srv.base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}x"}), 401, "invalid_api_key")


def test_request_id_on_every_answer(srv):
    mine = {"X-Request-Id": "client-id-42"}
    body = {"model": SMOL, "prompt": "Hi", "max_tokens": 2}
    assert _post(srv, "/v1/completions", json=body, headers=mine).headers["x-request-id"] == "client-id-42"
    assert _post(srv, "/v1/completions", json={**body, "n": 0}, headers=mine).headers["x-request-id"] == "client-id-42"
    assert httpx.get(f"{srv.base_url}/v1/models", headers=mine).headers["x-request-id"] == "client-id-42"  # a 401
    with httpx.stream("POST", f"{srv.base_url}/v1/completions", json={**body, "stream": True},
                      headers={**AUTH, **mine}, timeout=60) as resp:
        assert resp.headers["x-request-id"] == "client-id-42"
        resp.read()
    own = _post(srv, "/v1/completions", json=body)
    assert own.headers["x-request-id"] == own.json()["id"]
    with httpx.stream("POST", f"{srv.base_url}/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=60) as resp:
        first = json.loads(next(resp.iter_lines()).removeprefix("data: "))
        assert resp.headers["x-request-id"] == first["id"]


def test_access_log_and_trace_level_keep_no_text(srv):
    """The module's server runs at --log-level trace (it crashed at start before): still no query string,
    no prompt, no output in its log."""
    assert httpx.get(f"{srv.base_url}/v1/models?user={CANARY}", headers=AUTH).status_code == 200
    _post(srv, "/v1/completions", json={"model": SMOL, "prompt": f"Repeat: {CANARY}", "max_tokens": 8,
                                        "temperature": 0})
    log = srv.log_text()
    assert "HTTP connection made" in log  # trace lines are there
    assert "GET /v1/models 200" in log and "POST /v1/completions 200" in log
    assert CANARY not in log and "CANARY" not in log.upper()


def test_openapi_documents_400_not_422(srv):
    schema = httpx.get(f"{srv.base_url}/openapi.json").json()
    responses = [op["responses"] for ops in schema["paths"].values() for op in ops.values()]
    assert responses and all("422" not in r for r in responses)
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert chat["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert {"400", "413", "429"} <= set(chat)
    assert "HTTPValidationError" not in json.dumps(schema)


# ---- in process: a failure no real request can trigger on purpose ----

class _Boom(RuntimeError):
    pass


class _FakeEngine:
    """Enough of an EngineClient for the app; its tokenizer fails with a message that quotes the prompt."""

    max_model_len = 512
    max_num_waiting = 16
    healthy = True

    class input_processor:  # noqa: N801
        @staticmethod
        def tokenize(prompt):
            raise _Boom(f"cannot tokenize {prompt!r}")

    task = "generate"
    default_sampling: dict = {}

    def subscribe(self, on_output=None, on_abort=None) -> None:
        pass

    def stats(self):
        from sobrio.engine.client import EngineStats

        return EngineStats()


def test_unexpected_exception_is_an_openai_500_logged_by_type_only(caplog):
    from sobrio.config import CorsConfig, LimitsConfig
    from sobrio.server.app import create_app
    from sobrio.server.edge import edge_stack

    asgi, _ = edge_stack(create_app({SMOL: _FakeEngine()}), None, LimitsConfig(), CorsConfig())

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://t") as client:
            return await client.post("/v1/completions", json={"model": SMOL, "prompt": CANARY})

    resp = asyncio.run(call())
    error = _error(resp, 500)
    assert error["type"] == "server_error" and CANARY not in resp.text
    assert resp.headers["x-request-id"]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "_Boom at server/test_limits.py:" in logged  # the type and where, for whoever fixes it
    assert CANARY not in logged and not any(r.exc_info for r in caplog.records)


@pytest.mark.parametrize("require", [False, True])
def test_metrics_are_open_unless_they_require_a_key(require):
    from sobrio.config import CorsConfig, LimitsConfig
    from sobrio.server.app import create_app
    from sobrio.server.edge import edge_stack

    asgi, _ = edge_stack(create_app({SMOL: _FakeEngine()}), KEY, LimitsConfig(), CorsConfig(),
                         metrics_require_key=require)

    async def refused(headers: dict) -> list[bool]:
        """Whether the gate refused /metrics and /health (past it, the fake engine has no metrics to give)."""
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://t") as client:
            return [(await client.get(path, headers=headers)).status_code == 401 for path in ("/metrics", "/health")]

    assert asyncio.run(refused({})) == [require, False]
    assert asyncio.run(refused(AUTH)) == [False, False]
