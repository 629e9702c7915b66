"""`sobrio bench serve`'s client against canned SSE streams: which streams succeed, and what times them."""

import asyncio
import json
import time

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from sobrio.bench.client import request_body, send
from sobrio.bench.datasets import SampleRequest


def _stream(events: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def _send(events: list[dict], count_tokens=None):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=_stream(events), content_type="text/event-stream")

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        async with TestServer(app) as server, aiohttp.ClientSession() as client:
            sample = SampleRequest(prompt=[1, 2, 3], messages=None, prompt_len=3, output_len=2)
            return await send(client, str(server.make_url("/v1/completions")), {}, {}, time.perf_counter(),
                              sample, count_tokens)

    return asyncio.run(main())


def _piece(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def test_text_chunks_time_the_tokens_and_usage_counts_them():
    result = _send([_piece("a"), _piece("b", "length"), USAGE])
    assert result.success and result.output_tokens == 2
    assert len(result.chunk_times) == 2 and len(result.itl) == 1 and result.ttft > 0


def test_tokens_that_decode_to_no_text_are_received_not_lost():
    """Random weights often pick special tokens, whose text is empty: the server answered, the bench counts it."""
    result = _send([_piece(""), _piece("", "length"), USAGE])
    assert result.success, result.error
    assert result.output_tokens == 2 and len(result.chunk_times) == 2 and result.ttft > 0


def test_without_usage_empty_pieces_count_one_token_a_chunk():
    result = _send([_piece(""), _piece("", "length")], count_tokens=lambda text: len(text.split()))
    assert result.success and result.output_tokens == 2


def test_an_error_event_fails_the_request_even_after_text():
    error = {"error": {"message": "engine failed", "type": "server_error", "code": 500}}
    result = _send([_piece("a"), error])
    assert not result.success and "error" in result.error


def test_a_stream_without_choices_received_no_tokens():
    result = _send([USAGE])
    assert not result.success and result.error == "no tokens received"


def test_the_body_is_greedy_unless_sampling_is_asked_for():
    sample = SampleRequest(prompt=[1, 2, 3], messages=None, prompt_len=3, output_len=2)
    greedy = request_body(sample, "m", "completions", ignore_eos=True)
    assert greedy["temperature"] == 0 and "top_p" not in greedy and "top_k" not in greedy and greedy["ignore_eos"]
    sampled = request_body(sample, "m", "chat", ignore_eos=False, temperature=1.0, top_p=0.9, top_k=40)
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (1.0, 0.9, 40)
    assert sampled["messages"] == [{"role": "user", "content": "1 2 3"}] and "ignore_eos" not in sampled
