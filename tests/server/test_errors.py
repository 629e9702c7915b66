"""Bad input, unknown models, auth and overload: OpenAI error bodies, and the server stays healthy."""

import asyncio
import os

import httpx
import pytest

from tests.server.conftest import ServerProcess

SMOL = "smollm2-135m"


def _post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", timeout=60, **kwargs)


def _assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize("body,param", [
    ({"model": SMOL, "prompt": "hi", "max_tokens": "abc"}, "max_tokens"),
    ({"model": SMOL, "prompt": "hi", "max_tokens": "10"}, "max_tokens"),  # strict: a string is no integer
    ({"model": SMOL, "prompt": "hi", "n": "2"}, "n"),
    ({"model": SMOL, "prompt": "hi", "stream": "false"}, "stream"),
    ({"model": SMOL, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"model": SMOL, "prompt": "hi", "top_p": 2}, "top_p"),
    ({"model": SMOL, "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": SMOL, "prompt": ""}, "prompt"),
    ({"model": SMOL, "prompt": "word " * 2000}, "prompt"),
    ({"model": SMOL, "prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ({"model": SMOL, "prompt": "hi", "logit_bias": {"1": 200}}, "logit_bias"),
    ({"model": SMOL, "prompt": 123}, "prompt"),
    ({"model": SMOL}, "prompt"),
])
def test_bad_completion_requests(server, body, param):
    _assert_error(_post(server, "/v1/completions", json=body), 400, param)
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_bad_chat_and_json(server):
    _assert_error(_post(server, "/v1/chat/completions", content=b"{not json",
                        headers={"content-type": "application/json"}), 400)
    _assert_error(_post(server, "/v1/chat/completions", json={"model": SMOL, "messages": []}), 400, "messages")
    _assert_error(_post(server, "/v1/chat/completions",
                        json={"model": SMOL, "messages": [{"role": "wizard", "content": "x"}]}), 400, "messages")
    with_tools = {"model": SMOL, "messages": [{"role": "user", "content": "x"}], "tools": []}
    _assert_error(_post(server, "/v1/chat/completions", json=with_tools), 400, "tools")
    _assert_error(_post(server, "/v1/chat/completions",
                        json={"model": "gemma3-270m", "messages": [{"role": "user", "content": "x"}]}), 400)
    error = _assert_error(_post(server, "/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "model")
    assert error["code"] == "model_not_found"
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    ok = _post(server, "/v1/completions", json={"model": SMOL, "prompt": "Still alive?", "max_tokens": 3})
    assert ok.status_code == 200


def test_auth_overload_and_graceful_shutdown():
    srv = ServerProcess("--model", SMOL, "--api-key", "sekret", "--max-num-seqs", "1", "--max-num-waiting", "1",
                        "--kv-cache-memory", str(64 << 20), "--max-model-len", "512")
    try:
        _assert_error(_post(srv, "/v1/completions", json={"model": SMOL, "prompt": "x"}), 401)
        _assert_error(_post(srv, "/v1/completions", json={"model": SMOL, "prompt": "x"},
                            headers={"Authorization": "Bearer wrong"}), 401)
        auth = {"Authorization": "Bearer sekret"}

        async def burst():
            async with httpx.AsyncClient(timeout=120) as http:
                body = {"model": SMOL, "prompt": "Count to one hundred:", "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*(http.post(f"{srv.base_url}/v1/completions", json=body, headers=auth)
                                              for _ in range(8)))

        statuses = [r.status_code for r in asyncio.run(burst())]
        assert 429 in statuses and 200 in statuses
        rejected = next(r for r in asyncio.run(burst()) if r.status_code == 429)
        assert rejected.headers["retry-after"] and rejected.json()["error"]["type"] == "rate_limit_error"
        assert httpx.get(f"{srv.base_url}/health").status_code == 200
        assert _post(srv, "/v1/completions", json={"model": SMOL, "prompt": "x", "max_tokens": 2},
                     headers=auth).status_code == 200
    finally:
        status = srv.stop()
        os.unlink(srv.log.name)
    assert status == 0  # SIGTERM: graceful exit with status 0
