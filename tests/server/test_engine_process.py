"""The engine core in its own process: faults, aborts and shutdown across the boundary.

`sobrio serve` runs each model's core in a process of its own by default; every other server test
runs that way too. These tests hit what only the boundary can break.
"""

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from sobrio import SamplingParams
from tests.server.conftest import SMALL, serving, wait_until

SMOL = "smollm2-135m"


def core_pids(server_pid: int) -> list[int]:
    """The engine-core processes a server started (its multiprocessing children)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server_pid and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


async def stream_until_end(base_url: str, i: int, started: asyncio.Event) -> tuple[float, list[str]]:
    """A long stream's payloads and the time its last one came."""
    body = {"model": SMOL, "prompt": f"Stream {i} tells a long story:", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    payloads = []
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    payloads.append(line[6:])
                    started.set()
    return time.monotonic(), payloads


def test_kill_9_of_the_core_fails_streams_fast_then_serving_resumes():
    with serving(*SMALL) as srv:
        [pid] = core_pids(srv.proc.pid)

        async def run():
            started = asyncio.Event()
            tasks = [asyncio.create_task(stream_until_end(srv.base_url, i, started)) for i in range(16)]
            await started.wait()
            await asyncio.sleep(0.5)
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            return killed, await asyncio.gather(*tasks)

        killed, results = asyncio.run(run())
        for ended, payloads in results:
            assert ended - killed < 5, "a stream waited more than 5 s for its error"
            assert payloads[-1] == "[DONE]" and "error" in json.loads(payloads[-2]), payloads[-3:]
        assert httpx.get(f"{srv.base_url}/health").status_code == 503 or core_pids(srv.proc.pid) != [pid]
        assert wait_until(lambda: httpx.get(f"{srv.base_url}/health").status_code == 200, 60)
        [new_pid] = core_pids(srv.proc.pid)
        assert new_pid != pid
        resp = httpx.post(f"{srv.base_url}/v1/completions", timeout=60,
                          json={"model": SMOL, "prompt": "Still here?", "max_tokens": 4, "ignore_eos": True})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        assert wait_until(lambda: srv.metric("kv_cache_usage_perc", SMOL) == 0, 10)
        assert srv.stop() == 0
        assert not any(os.path.exists(f"/proc/{p}") for p in (pid, new_pid)), "a core outlived its server"


def test_aborts_across_the_boundary_free_every_block():
    with serving(*SMALL) as srv:
        def hang_up(i: int) -> None:
            body = {"model": SMOL, "prompt": f"Abort me {i}", "max_tokens": 300, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=60) as resp:
                next(resp.iter_lines())

        threads = [threading.Thread(target=hang_up, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        with pytest.raises(httpx.TimeoutException):  # a non-streamed request given up by its client
            httpx.post(f"{srv.base_url}/v1/completions", timeout=1.0,
                       json={"model": SMOL, "prompt": "Give up", "max_tokens": 400, "ignore_eos": True})
        assert wait_until(lambda: srv.metric("num_requests_running", SMOL) == 0
                          and srv.metric("kv_cache_usage_perc", SMOL) == 0, 10)
        text = httpx.get(f"{srv.base_url}/metrics").text
        tables = [line for line in text.splitlines() if line.startswith("sobrio:request_table_entries{")]
        assert tables and all(line.endswith(" 0.0") for line in tables), tables


def test_two_models_run_in_two_core_processes(server):
    pids = core_pids(server.proc.pid)
    assert len(pids) == 2, pids


def test_tokenizing_holds_up_no_step():
    """A slow tokenization (a huge prompt) must not stop the requests in flight from advancing."""
    from sobrio.config import SobrioConfig
    from sobrio.engine.async_llm import AsyncMPClient
    from tests.conftest import engine_kwargs

    client = AsyncMPClient(SobrioConfig.from_kwargs(model=SMOL, **engine_kwargs()))
    try:
        tokenize = client.engine.input_processor.tokenize
        release = threading.Event()

        def slow_tokenize(prompt):
            release.wait(10)
            return tokenize(prompt)

        async def run() -> tuple[int, bool]:
            greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            gen = client.generate("flowing", "Count slowly:", greedy)
            first = await anext(gen)
            client.engine.input_processor.tokenize = slow_tokenize
            blocked = asyncio.create_task(anext(client.generate("slow", "A slow prompt", greedy)))
            await asyncio.sleep(0.2)
            async for out in gen:
                tokens_while_blocked = len(out.outputs[0].token_ids) - len(first.outputs[0].token_ids)
                if tokens_while_blocked >= 10:
                    break
            still_blocked = not blocked.done()
            release.set()
            await gen.aclose()
            await blocked
            return tokens_while_blocked, still_blocked

        advanced, still_blocked = asyncio.run(run())
        assert advanced >= 10 and still_blocked
    finally:
        client.shutdown()


def test_process_client_equals_offline_greedy(smollm2):
    from sobrio.config import SobrioConfig
    from sobrio.engine.async_llm import AsyncMPClient
    from tests.conftest import engine_kwargs

    prompts = ["The sea is", "Paris is the capital of", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    offline = [o.outputs[0].token_ids for o in smollm2.generate(prompts, greedy, use_tqdm=False)]
    client = AsyncMPClient(SobrioConfig.from_kwargs(model=SMOL, **engine_kwargs()))
    try:
        async def one(i: int, prompt: str) -> list[int]:
            async for out in client.generate(f"eq-{i}", prompt, greedy):
                last = out
            return last.outputs[0].token_ids

        async def run():
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        assert asyncio.run(run()) == offline
    finally:
        client.shutdown()


def test_a_core_whose_server_is_killed_exits_by_itself():
    """kill -9 of the API process mid-stream: its core stops within seconds instead of running on."""
    with serving(*SMALL) as srv:
        [pid] = core_pids(srv.proc.pid)
        body = {"model": SMOL, "prompt": "Run on", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=60) as resp:
            next(resp.iter_lines())
            srv.proc.kill()
        assert wait_until(lambda: not os.path.exists(f"/proc/{pid}") or "Z" in _state(pid), 10)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_stale_socket_folders_are_swept_and_live_ones_kept(tmp_path):
    """Both processes SIGKILLed leave a socket folder behind; the next start removes it, never a live one."""
    import socket

    from sobrio.engine.core_process import STALE_FOLDER_AGE_S, sweep_stale_socket_folders

    old = time.time() - 2 * STALE_FOLDER_AGE_S
    folders = {name: tmp_path / f"sobrio-core-{name}" for name in ("dead", "live", "young", "empty")}
    for folder in folders.values():
        folder.mkdir()
    listeners = []
    for name in ("dead", "live", "young"):
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(folders[name] / "in"))
        listener.listen(1)
        listeners.append(listener)
    listeners[0].close()  # "dead": its socket file stays, nothing accepts
    listeners[2].close()  # "young" is as dead, but may be a start under way
    for name in ("dead", "live", "empty"):
        os.utime(folders[name], (old, old))
    try:
        assert sweep_stale_socket_folders(str(tmp_path)) == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == ["sobrio-core-live", "sobrio-core-young"]
    finally:
        listeners[1].close()
