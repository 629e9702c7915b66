"""Nothing on the engine's delivery path can stop it silently (issue 40).

A repeated structured request once made prometheus_client raise on the engine thread (its forced tokens
were counted as cached prompt tokens): the thread died, every later request of the model hung and /health
still said 200. These tests hold the three guarantees: the request finishes, a callback that raises is
survived, and a thread that dies anyway turns /health 503 and comes back.
"""

import asyncio
import json

import httpx
import pytest
from openai import OpenAI

from sobrio import SamplingParams
from tests.server.conftest import wait_until

SMOL = "smollm2-135m"
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}  # nearly every token forced


def test_the_same_json_schema_request_three_times_all_finish(server):
    """With fast-forward on (the default), the second identical request hit its own forced tokens in the
    prefix cache, and `cached_tokens` exceeded the prompt."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="x", timeout=60, max_retries=0)
    messages = [{"role": "user", "content": "Is the sea blue? Answer in JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    for _ in range(3):
        resp = client.chat.completions.create(model=SMOL, messages=messages, response_format=fmt, temperature=0,
                                              max_tokens=30)
        json.loads(resp.choices[0].message.content)  # complete: the grammar ended it
        cached = resp.usage.prompt_tokens_details.cached_tokens
        assert 0 <= cached <= resp.usage.prompt_tokens
    hi = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert hi.choices[0].message.content is not None
    assert httpx.get(f"{server.base_url}/health").status_code == 200


@pytest.fixture(scope="module")
def in_process():
    from sobrio.config import SobrioConfig
    from sobrio.engine.async_llm import AsyncLLM
    from tests.conftest import engine_kwargs

    client = AsyncLLM.from_config(SobrioConfig.from_kwargs(model=SMOL, **engine_kwargs()))
    try:
        yield client
    finally:
        client.shutdown()


async def _finish(client, request_id: str, prompt: str, max_tokens: int = 6):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    async for out in client.generate(request_id, prompt, params):
        last = out
    return last


def test_a_metric_that_throws_does_not_stop_the_engine(in_process):
    broken = [True]

    def broken_metric(output, now):
        if broken[0]:
            raise ValueError("Counters can only be incremented by non-negative amounts.")

    in_process.subscribe(on_output=broken_metric)
    try:
        async def run():
            first = await asyncio.wait_for(_finish(in_process, "m1", "One"), 60)
            both = await asyncio.wait_for(asyncio.gather(_finish(in_process, "m2", "Two"),
                                                         _finish(in_process, "m3", "Three")), 60)
            return [first, *both]

        outputs = asyncio.run(run())
    finally:
        broken[0] = False
    assert all(len(o.outputs[0].token_ids) == 6 and o.finished for o in outputs)
    assert in_process.callbacks.errors["ValueError"] >= 3 and in_process.thread_deaths == 0
    assert in_process.healthy and in_process.stats().callback_errors["ValueError"] >= 3


def test_an_engine_thread_death_turns_health_503_then_recovers():
    """The front raising on the engine thread (not a callback): its request fails at once, /health answers
    503 while the core restarts, then 200, and the model serves again."""
    from sobrio.config import SobrioConfig
    from sobrio.engine.async_llm import AsyncMPClient, EngineStepError
    from sobrio.server.app import create_app
    from tests.conftest import engine_kwargs

    client = AsyncMPClient(SobrioConfig.from_kwargs(model=SMOL, **engine_kwargs()))
    app = create_app({SMOL: client})
    try:
        first_pid = client.core.info.pid
        process_outputs = client.engine.process_outputs

        def dies_once(outputs):
            client.engine.process_outputs = process_outputs
            raise RuntimeError("a bug in the front")

        client.engine.process_outputs = dies_once

        async def health() -> int:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://sobrio") as http:
                return (await http.get("/health")).status_code

        async def run() -> list[int]:
            with pytest.raises(EngineStepError):
                await asyncio.wait_for(_finish(client, "dies", "Hello"), 30)
            seen = [await health()]
            for _ in range(600):  # bounded: 60 s
                if seen[-1] == 200:
                    break
                await asyncio.sleep(0.1)
                seen.append(await health())
            return seen

        seen = asyncio.run(run())
        assert seen[0] == 503 and seen[-1] == 200, seen
        assert client.thread_deaths == 1 and client.core.info.pid != first_pid
        out = asyncio.run(asyncio.wait_for(_finish(client, "after", "Still here?", 4), 60))
        assert len(out.outputs[0].token_ids) == 4
        assert wait_until(lambda: client.healthy, 1)
    finally:
        client.shutdown()


def test_a_failed_step_logs_its_type_and_place_never_its_message(in_process, caplog):
    """An exception's message (and its traceback's) may quote the request: the log names the type and the
    frame only, and the engine serves on."""
    from sobrio.engine.async_llm import EngineStepError

    step = in_process.engine.step

    def fails_once():
        in_process.engine.step = step
        raise RuntimeError("SECRET-USER-TEXT in an exception message")

    in_process.engine.step = fails_once
    caplog.set_level("DEBUG", logger="sobrio")
    try:
        with pytest.raises(EngineStepError):
            asyncio.run(asyncio.wait_for(_finish(in_process, "s1", "Private words"), 60))
    finally:
        in_process.engine.step = step
    logged = [r for r in caplog.records if "engine step failed" in r.getMessage()]
    assert logged and "RuntimeError" in logged[0].getMessage() and "fails_once" in logged[0].getMessage()
    assert "SECRET" not in caplog.text and not any(r.exc_info for r in caplog.records)
    out = asyncio.run(asyncio.wait_for(_finish(in_process, "s2", "Again", 4), 60))
    assert len(out.outputs[0].token_ids) == 4
