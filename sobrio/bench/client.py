"""One streamed request to any OpenAI-compatible server, timed chunk by chunk.

aiohttp, as vLLM's `bench serve`: the client shares the server's cores here, and httpx's per-chunk cost
(anyio timeouts, httpcore's events) took measurable CPU from the servers (figures: docs/benchmarks.md,
"The bench client"). A client's cost must not be read as the server's.
"""

import json
import time

import aiohttp

from sobrio.bench.datasets import SampleRequest
from sobrio.bench.summary import RequestResult


def request_body(sample: SampleRequest, model: str, endpoint: str, ignore_eos: bool, temperature: float = 0.0,
                 top_p: float | None = None, top_k: int | None = None) -> dict:
    """A streamed request's body: greedy unless `temperature`; top_p and top_k sent only where given."""
    body: dict = {"model": model, "max_tokens": sample.output_len, "stream": True, "temperature": temperature,
                  "stream_options": {"include_usage": True}}
    if top_p is not None:
        body["top_p"] = top_p
    if top_k is not None:
        body["top_k"] = top_k  # vLLM's extra parameter, as sobrio's
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        body["messages"] = sample.messages or [{"role": "user", "content": _as_text(sample.prompt)}]
    else:
        body["prompt"] = sample.prompt if sample.prompt is not None else _messages_text(sample.messages)
    return body


def _as_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt or []))


def _messages_text(messages) -> str:
    return "\n".join(m["content"] for m in messages or [])


async def send(client: aiohttp.ClientSession, url: str, body: dict, headers: dict, t0: float,
               sample: SampleRequest, count_tokens=None) -> RequestResult:
    """Stream one request. Token counts come from the server's `usage`; a server that sends none is
    counted with `count_tokens(text)` (the dataset's tokenizer), else one token per chunk.

    Chunks with text time the tokens. A stream that answered only in empty pieces (tokens that decode to no
    text, as random weights' special tokens do) is timed by its chunks with choices instead of being counted
    as a failure: the server did deliver its tokens."""
    result = RequestResult(prompt_tokens=sample.prompt_len, start=time.perf_counter() - t0)
    sent = time.perf_counter()
    pieces, empty_times = [], []
    try:
        async with client.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                await resp.read()
                result.error = f"HTTP {resp.status}"
                return result
            async for raw in resp.content:  # one SSE line at a time
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if data.get("error"):  # the server cut the stream: the request failed, whatever came before
                    result.error = "error event in the stream"
                    return result
                if data.get("usage"):
                    result.prompt_tokens = data["usage"].get("prompt_tokens", result.prompt_tokens)
                    result.output_tokens = data["usage"].get("completion_tokens", 0)
                if _has_content(data):
                    result.chunk_times.append(time.perf_counter() - t0)
                    pieces.append(_content(data))
                elif data.get("choices"):
                    empty_times.append(time.perf_counter() - t0)
        result.e2e = time.perf_counter() - sent
        if not result.chunk_times:
            result.chunk_times = empty_times
        if not result.chunk_times:
            result.error = "no tokens received"
            return result
        result.ttft = result.chunk_times[0] - (sent - t0)
        result.itl = [b - a for a, b in zip(result.chunk_times, result.chunk_times[1:])]
        if not result.output_tokens:
            text = "".join(pieces)
            result.output_tokens = count_tokens(text) if count_tokens and text else len(result.chunk_times)
        result.success = True
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: bad JSON, text or line
        result.error = type(exc).__name__
    return result


def _content(data: dict) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in data.get("choices") or [])


def _has_content(data: dict) -> bool:
    for choice in data.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False
