"""SIGTERM with requests in flight: short ones finish, long ones end with an OpenAI error at the deadline (a
stream: an error event, then [DONE]), and the server exits 0."""

import asyncio
import json
import signal
import time

import httpx

from tests.server.conftest import SMALL, serving

SMOL = "smollm2-135m"
DEADLINE = 4.0
LONG = {"model": SMOL, "prompt": "Tell a very long story.", "max_tokens": 450, "ignore_eos": True}


async def _stream(client: httpx.AsyncClient, body: dict, started: asyncio.Event) -> list[tuple[float, str]]:
    """Every `data:` payload of one stream, with the time it came."""
    events = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line.removeprefix("data: ")))
                started.set()
    return events


async def _sigterm_under_load(srv) -> tuple[float, list, list, httpx.Response]:
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
        plain = asyncio.create_task(client.post("/v1/completions", json=LONG))
        flags = [asyncio.Event() for _ in range(4)]
        longs = [asyncio.create_task(_stream(client, LONG, f)) for f in flags[:3]]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags[:3])), 60)
        short = asyncio.create_task(_stream(client, {**LONG, "max_tokens": 8}, flags[3]))
        await asyncio.wait_for(flags[3].wait(), 60)
        srv.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        return sent, await asyncio.gather(*longs), await short, await plain


def test_sigterm_drains_then_ends_streams_with_an_error_event():
    with serving(*SMALL, "--shutdown-timeout", str(DEADLINE)) as srv:
        sent, longs, short, plain = asyncio.run(_sigterm_under_load(srv))
        assert srv.proc.wait(30) == 0
        stopped = time.monotonic() - sent

    assert short[-1][1] == "[DONE]" and json.loads(short[-2][1])["choices"][0]["finish_reason"] == "length"
    for events in longs:
        (cut_at, last), (_, done) = events[-2], events[-1]
        error = json.loads(last)["error"]
        assert done == "[DONE]" and set(error) == {"message", "type", "param", "code"}
        assert "shutting down" in error["message"]
        assert DEADLINE - 0.5 < cut_at - sent < DEADLINE + 5  # drained until the deadline, not cut at once
        assert len(events) > 3 and all("choices" in json.loads(e) for _, e in events[:-2])
    assert plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"]
    assert stopped < DEADLINE + 10
