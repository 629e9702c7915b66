"""Engine-core memory under a steady mixed load: RSS over time, and its growth after the first minute.

    python benchmarks/soak.py                      # 10 minutes, 16 clients (the acceptance run)
    python benchmarks/soak.py --minutes 3 --clients 8

It starts `sobrio serve smollm2-135m` (its engine core in a process of its own), then runs `--clients`
loops until `--minutes` pass or `--max-requests` are sent: plain and streamed completions and chats,
streams the client hangs up on after a few chunks, json_schema answers (a few schemas, some new each
time), and tool calls. Every `--every` seconds it prints the engine core's resident memory (and the API
process's), its KV use and the requests so far; at the end the growth of the core's RSS from the one-minute
mark to the end, in percent, and the count of answers by status. Bounded: the loops stop at the deadline,
every request has a timeout, the server is stopped on the way out.
"""

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.server.conftest import ServerProcess  # noqa: E402 - the server harness of the tests
from tests.server.test_engine_process import core_pids  # noqa: E402

SMOL = "smollm2-135m"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
WORDS = "the sea river mountain city train coffee music garden winter light story robot cloud".split()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def schema(rng: random.Random) -> dict:
    """A few fixed schemas, and one in eight with a new field name (new grammars keep coming)."""
    name = f"f{rng.randrange(10**6)}" if rng.random() < 0.125 else rng.choice(["name", "city", "title"])
    return {"type": "object", "properties": {name: {"type": "string", "maxLength": 16}, "n": {"type": "integer"}},
            "required": [name, "n"], "additionalProperties": False}


def one_body(rng: random.Random) -> tuple[str, dict, bool]:
    """(path, body, hang up early): one request of the mix."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120)))
    kind = rng.choice(["completion", "stream", "chat", "hangup", "json", "tools"])
    chat = {"model": SMOL, "messages": [{"role": "user", "content": text}], "max_tokens": rng.randint(8, 48)}
    if kind == "completion":
        return "/v1/completions", {"model": SMOL, "prompt": text, "max_tokens": rng.randint(8, 64)}, False
    if kind in ("stream", "hangup"):
        return "/v1/completions", {"model": SMOL, "prompt": text, "max_tokens": 64, "stream": True}, kind == "hangup"
    if kind == "json":
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema(rng)}}
        return "/v1/chat/completions", {**chat, "response_format": fmt, "temperature": 0}, False
    if kind == "tools":
        return "/v1/chat/completions", {**chat, "tools": TOOLS, "tool_choice": "required"}, False
    return "/v1/chat/completions", chat, False


async def client_loop(http: httpx.AsyncClient, seed: int, deadline: float, budget: list[int], status: Counter):
    rng = random.Random(seed)
    while time.monotonic() < deadline and budget[0] > 0:
        budget[0] -= 1
        path, body, hang_up = one_body(rng)
        try:
            if body.get("stream"):
                async with http.stream("POST", path, json=body) as resp:
                    chunks = 0
                    async for _ in resp.aiter_lines():
                        chunks += 1
                        if hang_up and chunks >= 3:
                            break
                    status[resp.status_code] += 1
            else:
                status[(await http.post(path, json=body)).status_code] += 1
        except httpx.HTTPError as exc:
            status[type(exc).__name__] += 1


async def sample_memory(srv: ServerProcess, core: int, deadline: float, every: float, rows: list):
    start = time.monotonic()
    while True:
        kv = srv.metric("kv_cache_usage_perc", SMOL)
        rows.append((time.monotonic() - start, rss_mb(core), rss_mb(srv.proc.pid), kv))
        t, core_mb, api_mb, _ = rows[-1]
        print(f"{t:6.0f} s  core RSS {core_mb:8.1f} MB  API RSS {api_mb:8.1f} MB  KV {kv:5.1%}", flush=True)
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(min(every, max(0.0, deadline - time.monotonic())))


async def soak(srv: ServerProcess, args) -> tuple[list, Counter]:
    [core] = core_pids(srv.proc.pid)
    deadline = time.monotonic() + args.minutes * 60
    status: Counter = Counter()
    rows: list = []
    budget = [args.max_requests]
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as http:
        loops = [client_loop(http, i, deadline, budget, status) for i in range(args.clients)]
        await asyncio.gather(sample_memory(srv, core, deadline, args.every, rows), *loops)
    await asyncio.sleep(2)  # the last hang-ups reach the core
    rows.append((rows[-1][0] + 2, rss_mb(core), rss_mb(srv.proc.pid), srv.metric("kv_cache_usage_perc", SMOL)))
    return rows, status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the load runs (default 10)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent client loops (default 16)")
    parser.add_argument("--max-requests", type=int, default=20000, help="requests at most (default 20000)")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between RSS samples (default 30)")
    args = parser.parse_args()
    srv = ServerProcess("--model", SMOL, "--max-model-len", "1024", "--disable-log-requests")
    try:
        rows, status = asyncio.run(soak(srv, args))
    finally:
        srv.stop()
        os.unlink(srv.log.name)
    after_minute = next((r for r in rows if r[0] >= 60), rows[0])
    end = rows[-1]
    growth = (end[1] - after_minute[1]) / after_minute[1]
    print(f"answers: {dict(status)}")
    print(f"core RSS at {after_minute[0]:.0f} s: {after_minute[1]:.1f} MB, at the end ({end[0]:.0f} s): "
          f"{end[1]:.1f} MB, growth after the first minute: {growth:+.1%}")
    print(json.dumps({"rss_mb": [[round(t), round(c, 1)] for t, c, _, _ in rows], "growth": growth}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
