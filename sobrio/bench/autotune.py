"""`sobrio bench autotune`: for each (--max-num-seqs, --max-num-batched-tokens) candidate, start
`sobrio serve`, find the highest request rate whose p99 latencies meet the SLOs (doubling, then bisecting),
and print the best configuration and the whole table. Bounded by --time-budget."""

import asyncio
import copy
import itertools
import json
import subprocess
import sys
import time

import httpx

from sobrio.bench.serve import add_serve_args, load_dataset, parse_slos, run_requests
from sobrio.bench.summary import summarize


def add_autotune_args(parser) -> None:
    add_serve_args(parser)
    parser.add_argument("--max-num-seqs-grid", default="8,32")
    parser.add_argument("--max-num-batched-tokens-grid", default="512,2048")
    parser.add_argument("--slo", nargs="+", default=["tpot:500"], help="p99 bounds: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--time-budget", type=float, default=900.0, help="seconds for the whole search")
    parser.add_argument("--start-rate", type=float, default=1.0)
    parser.add_argument("--max-rate", type=float, default=64.0)
    parser.add_argument("--bisect-steps", type=int, default=2)
    parser.add_argument("--serve-args", default="", help="extra flags for sobrio serve")


def p99_meets(summary: dict, slos: dict[str, float]) -> bool:
    return summary["failed"] == 0 and all(summary[f"p99_{name}_ms"] <= limit for name, limit in slos.items())


class ServerUnderTest:
    def __init__(self, model: str, port: int, flags: list[str]):
        cmd = [sys.executable, "-m", "sobrio.cli", "serve", "--model", model, "--port", str(port), *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"sobrio serve did not start with {flags}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def best_rate(args, samples, slos, deadline: float) -> tuple[float, dict | None]:
    """Double the rate while the SLOs hold, then bisect between the last good and first bad rate."""
    good, good_summary, bad, rate = 0.0, None, None, args.start_rate
    while time.monotonic() < deadline:
        point = copy.copy(args)
        point.request_rate = rate
        results, duration = asyncio.run(run_requests(point, samples))
        summary = summarize(results, duration, [99.0])
        if p99_meets(summary, slos):
            good, good_summary = rate, summary
        else:
            bad = rate
        if bad is None:
            if rate >= args.max_rate:
                break
            rate = min(rate * 2, args.max_rate)
        else:
            if args.bisect_steps <= 0 or (good and bad - good < 0.05 * bad):
                break
            args = copy.copy(args)
            args.bisect_steps -= 1
            rate = (good + bad) / 2 if good else bad / 2
    return good, good_summary


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cmd_bench_autotune(args) -> int:
    slos = parse_slos(args.slo)
    samples = load_dataset(args)
    deadline = time.monotonic() + args.time_budget
    grid = itertools.product([int(x) for x in args.max_num_seqs_grid.split(",")],
                             [int(x) for x in args.max_num_batched_tokens_grid.split(",")])
    table = []
    for seqs, tokens in grid:
        if time.monotonic() >= deadline:
            print("time budget spent; remaining candidates skipped")
            break
        flags = ["--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(tokens), *args.serve_args.split()]
        server = ServerUnderTest(args.model, free_port(), flags)
        try:
            point = copy.copy(args)
            point.base_url = server.base_url
            rate, summary = best_rate(point, samples, slos, deadline)
        finally:
            server.stop()
        row = {"max_num_seqs": seqs, "max_num_batched_tokens": tokens, "best_request_rate": rate,
               "output_throughput": summary["output_throughput"] if summary else 0.0,
               **({f"p99_{k}_ms": summary[f"p99_{k}_ms"] for k in ("ttft", "tpot", "e2el")} if summary else {})}
        table.append(row)
        print(json.dumps(row), flush=True)
    if not table:
        return 1
    best = max(table, key=lambda r: (r["best_request_rate"], r["output_throughput"]))
    print("best configuration:", json.dumps(best))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"slos_p99_ms": slos, "best": best, "table": table}, f, indent=2)
    return 0 if best["best_request_rate"] > 0 else 1
