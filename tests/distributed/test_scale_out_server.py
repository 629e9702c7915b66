"""Scale-out behind `sobrio serve`: data-parallel replicas, disaggregated prefill/decode (shared memory and
TCP) and tensor parallelism give the greedy tokens of one engine; a replica or a rank killed mid-run fails
only what it held, promptly, and the server recovers as documented."""

import asyncio
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from sobrio import SamplingParams
from tests.server.conftest import serving, wait_until

pytestmark = pytest.mark.slow

SMOL = "smollm2-135m"
FLAGS = ("--model", SMOL, "--dtype", "float32", "--kv-cache-memory", str(64 << 20), "--max-model-len", "512")
SHARED = "You are a terse assistant. Answer in one short sentence, without any preamble or apology. "
PROMPTS = [SHARED * 2 + q for q in ("What is a prime number?", "Why is the sky blue?", "Name a large river.",
                                    "What does a compiler do?")] + ["The capital of France is", "def add(a, b):"]


def children(pid: int) -> dict[int, bytes]:
    """pid -> command line of each process whose parent is `pid`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == pid:
                    found[int(entry.name)] = (entry / "cmdline").read_bytes()
            except (OSError, IndexError):
                continue
    return found


def core_pids(server_pid: int) -> list[int]:
    return sorted(p for p, cmd in children(server_pid).items() if b"spawn_main" in cmd)


async def complete_all(base_url: str, prompts: list[str], max_tokens: int = 16) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async def one(prompt):
            resp = await client.post("/v1/completions", json={"model": SMOL, "prompt": prompt, "temperature": 0,
                                                              "max_tokens": max_tokens, "ignore_eos": True})
            return resp.json() if resp.status_code == 200 else {"status": resp.status_code, **resp.json()}
        return await asyncio.gather(*(one(p) for p in prompts))


@pytest.fixture(scope="module")
def expected(smollm2) -> list[str]:
    outputs = smollm2.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def texts(results: list[dict]) -> list[str]:
    assert all("choices" in r for r in results), [r for r in results if "choices" not in r][:1]
    return [r["choices"][0]["text"] for r in results]


def metric_lines(base_url: str, name: str) -> dict[str, float]:
    """engine label -> value of one sobrio metric for the model."""
    values = {}
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(f"sobrio:{name}{{") and f'model_name="{SMOL}"' in line:
            values[line.split('engine="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return values


def test_two_data_parallel_replicas_answer_as_one_engine_and_survive_one_dying(expected):
    with serving(*FLAGS, "--data-parallel-size", "2") as srv:
        assert "dp0: engine core pid" in srv.log_text() and "dp1: engine core pid" in srv.log_text()
        results = asyncio.run(complete_all(srv.base_url, PROMPTS))
        assert texts(results) == expected
        queries = metric_lines(srv.base_url, "prefix_cache_queries_total")
        assert set(queries) == {"0", "1"} and all(v > 0 for v in queries.values())  # both replicas served
        # the shared prompt went back to the replica that cached it
        assert sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results) > 0

        pids = core_pids(srv.proc.pid)
        assert len(pids) == 2

        async def kill_one_mid_run():
            task = asyncio.create_task(complete_all(srv.base_url, PROMPTS * 2, max_tokens=200))
            await asyncio.sleep(2.0)
            os.kill(pids[0], signal.SIGKILL)
            killed = time.monotonic()
            return await task, killed, time.monotonic()

        results, killed, ended = asyncio.run(kill_one_mid_run())
        failed = [r for r in results if "choices" not in r]
        assert 0 < len(failed) < len(results), "only the dead replica's requests fail"
        assert all(r["status"] == 500 for r in failed)
        assert httpx.get(f"{srv.base_url}/health").status_code == 200  # the other replica kept serving
        assert wait_until(lambda: len(core_pids(srv.proc.pid)) == 2 and pids[0] not in core_pids(srv.proc.pid), 60)
        assert texts(asyncio.run(complete_all(srv.base_url, PROMPTS))) == expected
        assert srv.stop() == 0


@pytest.mark.parametrize("connector", ["SharedMemoryConnector",
                                       pytest.param("TcpConnector", marks=pytest.mark.exhaustive)])
def test_disaggregated_prefill_and_decode_answer_as_one_engine(connector, expected):
    segments_before = set(os.listdir("/dev/shm"))
    with serving(*FLAGS, "--kv-transfer-config", f'{{"kv_connector": "{connector}"}}') as srv:
        assert "prefill: engine core pid" in srv.log_text() and "decode: engine core pid" in srv.log_text()
        results = asyncio.run(complete_all(srv.base_url, PROMPTS))
        assert texts(results) == expected
        # the long prompts' full blocks came from the prefill core: the decode core found them cached
        assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 for r in results[:4])
        sent = metric_lines(srv.base_url, "kv_transfer_bytes_sent_total")["prefill"]
        received = metric_lines(srv.base_url, "kv_transfer_bytes_received_total")["decode"]
        assert sent == received > 0
        assert srv.stop() == 0
    assert set(os.listdir("/dev/shm")) <= segments_before  # every segment was unlinked


def test_tensor_parallel_server_answers_as_one_engine_and_restarts_the_group(expected):
    with serving(*FLAGS, "--tensor-parallel-size", "2") as srv:
        assert "tensor-parallel rank 1: pid" in srv.log_text()
        assert texts(asyncio.run(complete_all(srv.base_url, PROMPTS))) == expected
        assert metric_lines(srv.base_url, "tensor_parallel_size") == {"0": 2.0}
        calls = [line for line in httpx.get(f"{srv.base_url}/metrics").text.splitlines()
                 if line.startswith("sobrio:tensor_parallel_collective_calls_total{") and "all_reduce" in line]
        assert calls and float(calls[0].rsplit(" ", 1)[1]) > 0
        [core] = core_pids(srv.proc.pid)
        [rank1] = [p for p, cmd in children(core).items() if b"sobrio.engine.tp_worker" in cmd]

        async def kill_rank_mid_run():
            task = asyncio.create_task(complete_all(srv.base_url, PROMPTS, max_tokens=300))
            await asyncio.sleep(2.0)
            os.kill(rank1, signal.SIGKILL)
            killed = time.monotonic()
            results = await task
            return results, time.monotonic() - killed

        results, waited = asyncio.run(kill_rank_mid_run())
        assert all(r.get("status") == 500 for r in results) and waited < 10
        assert wait_until(lambda: httpx.get(f"{srv.base_url}/health").status_code == 200 and
                          core_pids(srv.proc.pid) not in ([], [core]), 90)
        assert texts(asyncio.run(complete_all(srv.base_url, PROMPTS))) == expected
        assert srv.stop() == 0


@pytest.mark.exhaustive  # Ray itself is tested with tensor parallelism (tests/distributed/test_tensor_parallel.py)
def test_data_parallel_replicas_placed_by_ray_answer_as_one_engine(expected, monkeypatch):
    pytest.importorskip("ray")
    folder = tempfile.mkdtemp(prefix="ray-")  # short: Ray's Unix sockets live under it (107 bytes at most)
    monkeypatch.setenv("RAY_TMPDIR", folder)  # the local cluster's session files go with the test
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        with serving(*FLAGS, "--data-parallel-size", "2", "--distributed-executor-backend", "ray") as srv:
            assert srv.log_text().count("engine core in a Ray actor") >= 2
            assert texts(asyncio.run(complete_all(srv.base_url, PROMPTS))) == expected
            assert srv.stop() == 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
