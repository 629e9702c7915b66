"""The gateway end to end on a real server (both models, the router, two tenants): prints the gate's added
latency (a tenant's key, with key lookup, limits and the ledger row, against the operator's key on the same
server, 32 requests in flight), the router's decision time, the energy per output token of each model from
the ledger, and the router's split; writes the dashboard's screenshot where Chromium is installed.

    .venv/bin/python benchmarks/gateway_demo.py [--requests 96] [--shot docs/dashboard.png]
"""

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sobrio.gateway.router_data import read_set  # noqa: E402
from sobrio.gateway.tenants import TenantStore  # noqa: E402
from tests.server.conftest import serving  # noqa: E402

OPERATOR = "operator-demo-key"


async def timed_requests(base_url: str, key: str, bodies: list[dict], in_flight: int) -> list[float]:
    """Each request's seconds, `in_flight` at a time."""
    gate = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as c:
        async def one(body: dict) -> float:
            async with gate:
                start = time.perf_counter()
                answer = await c.post("/v1/completions", json=body)
                answer.raise_for_status()
                return time.perf_counter() - start
        return await asyncio.gather(*(one(b) for b in bodies))


def gate_cost(store: TenantStore, key: str, n: int = 2000) -> float:
    """Seconds the gate adds to one request in this process: key lookup, limits, the ledger row (an app
    that answers at once stands for the server)."""
    from sobrio.gateway.gate import TenantGate
    from sobrio.gateway.ledger import Ledger

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def sink(message):
        pass

    gate = TenantGate(app, OPERATOR, store, Ledger(store.db), "ITA")
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"authorization", f"Bearer {key}".encode())]}

    async def run() -> float:
        start = time.perf_counter()
        for _ in range(n):
            await gate(dict(scope), None, sink)
        return (time.perf_counter() - start) / n

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--shot", default=None, help="write the dashboard's screenshot here (needs chromium)")
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="sobrio-gateway-demo-")  # removed at exit
    folder = Path(scratch.name)
    store = TenantStore(folder / "gateway.db")
    keys = {}
    for name in ("acme", "globex"):
        store.create_tenant(name)
        keys[name] = store.create_key(name)[1]
    questions = [f"Question: {r['prompt']}\nAnswer:" for r in read_set("heldout")]
    scratch = TenantStore(folder / "scratch.db")  # the gate's own timing writes its rows there
    scratch.create_tenant("timing")
    timing_key = scratch.create_key("timing")[1]
    print(f"gate per request, in process: {gate_cost(scratch, timing_key) * 1e6:.0f} us with a tenant's key "
          f"(lookup, limits, ledger row), {gate_cost(scratch, OPERATOR) * 1e6:.0f} us with the operator's")
    scratch.close()
    try:
        with serving("--dtype", "float32", "--db", str(folder / "gateway.db"), "--region", "ITA", "--api-key",
                     OPERATOR, "--disable-log-requests") as srv:
            def short(tag: str) -> list[dict]:  # a tag first: no request finds another's prompt in the cache
                return [{"model": "smollm2-135m", "prompt": f"[{tag}] {q}", "max_tokens": 1}
                        for q in questions[:args.requests]]

            asyncio.run(timed_requests(srv.base_url, OPERATOR, short("warm-up")[:16], 16))
            rounds = {"operator": [], "tenant": []}
            for i in range(3):  # interleaved: both see the same machine state
                rounds["operator"] += asyncio.run(timed_requests(srv.base_url, OPERATOR, short(f"o{i}"), 32))
                rounds["tenant"] += asyncio.run(timed_requests(srv.base_url, keys["acme"], short(f"t{i}"), 32))
            p50 = {k: statistics.median(v) * 1e3 for k, v in rounds.items()}
            print(f"32 in flight, max_tokens 1, {args.requests} requests x 3 rounds: p50 operator key "
                  f"{p50['operator']:.1f} ms, tenant key {p50['tenant']:.1f} ms (gate added "
                  f"{p50['tenant'] - p50['operator']:+.1f} ms)")
            auto = [{"model": "auto", "prompt": q, "max_tokens": 16} for q in questions[:args.requests]]
            for name in ("acme", "globex"):
                asyncio.run(timed_requests(srv.base_url, keys[name], auto[::2] if name == "acme" else auto[1::2], 8))
            _report(srv.base_url, store)
            if args.shot and shutil.which("chromium"):
                subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={args.shot}",
                                "--window-size=1000,1500", f"--user-data-dir={folder / 'chromium'}",
                                f"{srv.base_url}/dashboard?key={OPERATOR}"], capture_output=True, timeout=120)
                print(f"dashboard screenshot: {args.shot}")
    finally:
        store.close()
        shutil.rmtree(folder, ignore_errors=True)


def _report(base_url: str, store: TenantStore) -> None:
    rows = store.db.execute("SELECT served_model, SUM(energy_j), SUM(completion_tokens), SUM(prompt_tokens), "
                            "energy_source FROM usage WHERE requested_model = 'auto' GROUP BY served_model").fetchall()
    for model, joules, completion, prompt, source in rows:
        print(f"{model}: {joules / max(completion, 1):.3f} J per output token ({joules:.1f} J over {prompt} prompt "
              f"and {completion} output tokens, {source})")
    split = dict(store.db.execute("SELECT served_model, COUNT(*) FROM usage WHERE requested_model = 'auto' "
                                  "GROUP BY served_model").fetchall())
    print(f"router split: {split}")
    metrics = httpx.get(f"{base_url}/metrics").text
    print("ledger rows:", store.db.execute("SELECT COUNT(*) FROM usage").fetchone()[0], "| /metrics lines:",
          len(metrics.splitlines()))


if __name__ == "__main__":
    main()
