"""What a gateway in front of a remote backend adds: one smollm2 replica (`sobrio serve`) and a gateway of
remote backends only (`sobrio serve --config`, with a tenant key, its limits and its ledger row) in front
of it; the same completions sent straight to the replica and through the gateway, alternating rounds,
32 in flight. Prints p50 and p99 of each, the p50 the gateway adds, and the gateway process's CPU time per
request (on this 2-core host it shares the cores with the replica's engine: its CPU is what it takes from
the engine), for one output token and for 16.

    .venv/bin/python benchmarks/gateway_proxy.py [--requests 96] [--rounds 3]
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_demo import timed_requests as timed  # noqa: E402

from sobrio.gateway.tenants import TenantStore  # noqa: E402
from tests.server.conftest import SMALL, serving  # noqa: E402


def percentiles(seconds: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(seconds, n=100)
    return statistics.median(seconds) * 1e3, cuts[98] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=32)
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="sobrio-gateway-proxy-")  # removed at exit
    folder = Path(scratch.name)
    store = TenantStore(folder / "gateway.db")
    store.create_tenant("bench")
    key = store.create_key("bench")[1]
    store.close()
    with serving(*SMALL, "--db", str(folder / "replica.db"), "--disable-log-requests") as replica:
        (folder / "gateway.toml").write_text(f'[[models.smollm2-135m.remote]]\nurl = "{replica.base_url}/v1"\n')
        with serving("--config", str(folder / "gateway.toml"), "--db", str(folder / "gateway.db"),
                     "--disable-log-requests") as gateway:
            for tokens in (1, 16):
                bodies = [{"model": "smollm2-135m", "prompt": f"Request {i}: a story about", "max_tokens": tokens,
                           "ignore_eos": True} for i in range(args.requests)]
                asyncio.run(timed(replica.base_url, "none", bodies[:8], 8))  # warm both paths
                asyncio.run(timed(gateway.base_url, key, bodies[:8], 8))
                direct, proxied, cpu = [], [], 0.0
                process = psutil.Process(gateway.proc.pid)
                for _ in range(args.rounds):
                    direct += asyncio.run(timed(replica.base_url, "none", bodies, args.in_flight))
                    before = sum(process.cpu_times()[:2])
                    proxied += asyncio.run(timed(gateway.base_url, key, bodies, args.in_flight))
                    cpu += sum(process.cpu_times()[:2]) - before
                (d50, d99), (g50, g99) = percentiles(direct), percentiles(proxied)
                print(f"max_tokens={tokens:<3} {args.in_flight} in flight, {len(direct)} requests each: "
                      f"direct p50 {d50:.1f} ms p99 {d99:.1f} ms | through the gateway p50 {g50:.1f} ms "
                      f"p99 {g99:.1f} ms | added p50 {g50 - d50:+.1f} ms ({g50 / d50:.2f}x) | gateway CPU "
                      f"{cpu / len(proxied) * 1e3:.2f} ms per request")


if __name__ == "__main__":
    main()
