"""Throughput at 16 in flight with an idle CPU and beside a one-core busy neighbour, and their ratio; or
(`--first-token N`) the time to first token of an N-token prompt sent just as such a neighbour stops.

    python benchmarks/cpu_neighbour.py            # ~2-4 min on 2 cores; prints idle, neighbour, ratio
    python benchmarks/cpu_neighbour.py --fixed     # the same with the threads and spin fixed as before issue 40
    python benchmarks/cpu_neighbour.py --first-token 1000 --model /tmp/sobrio-shapes/llama3.2-1b [--rounds 5]
        [--baseline /path/to/old/checkout]

It starts `sobrio serve` (SmolLM2, bf16), runs `sobrio bench serve` (random prompts, 16 in flight, fixed
output length) on an idle CPU, then again while it runs a neighbour of its own (a Python busy loop, one
core), stops it, and prints output tokens/s of both runs and neighbour/idle. `--fixed` starts the server
with OMP_NUM_THREADS = all cores and the long OpenMP spin, the policy before `engine/cpu_share.py`.
A quiet host is needed for a figure worth quoting: other processes are neighbours too.

`--first-token N` times, round after round, a fresh N-token prompt (random token ids, 1 output token) on a
quiet CPU, then another sent the moment a neighbour that ran for `LOWER_AFTER_S` + 2 s (long enough for the
governor to leave the engine one thread) is killed: the second waits for the governor to give the threads back.
It prints each pair and the medians' ratio (after a neighbour over quiet; 1.0 is no cost). `--baseline DIR`
serves that checkout too, both up at once and their requests in turns, and prints the two builds' ratio.
"""

import argparse
import contextlib
import datetime
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import httpx  # noqa: E402

from sobrio.engine.cpu_share import LOWER_AFTER_S  # noqa: E402
from tests.server.conftest import ServerProcess  # noqa: E402 - the server harness of the tests

RAISE = re.compile(r"CPU shared: (\d+) -> (\d+) engine threads")
NEIGHBOUR = "import time\nend = time.monotonic() + 900\nwhile time.monotonic() < end:\n    pass\n"


def served_model(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def first_token_s(base_url: str, tokens: int, seed: int, timeout: float) -> float:
    """Seconds to the first (and only) token of a prompt of `tokens` random ids, its own (no cache hit)."""
    model = served_model(base_url)
    rng = random.Random(seed)
    body = {"model": model, "prompt": [rng.randrange(100, 30000) for _ in range(tokens)], "max_tokens": 1,
            "temperature": 0}
    start = time.perf_counter()
    httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout).raise_for_status()
    return time.perf_counter() - start


@contextlib.contextmanager
def busy_neighbour():
    """A one-core busy loop while the block runs, killed as it ends (also when it fails)."""
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR])
    try:
        yield
    finally:
        neighbour.kill()
        neighbour.wait()


def raise_lag_s(log: str, sent_at: float, done_at: float) -> float | None:
    """Seconds from a request's sending to the governor's first raise of the threads during it (its log line),
    None if it raised none (it had not lowered, or raised before)."""
    for line in log.splitlines():
        found = RAISE.search(line)
        if found and int(found.group(2)) > int(found.group(1)):
            at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if sent_at - 0.05 <= at <= done_at:
                return at - sent_at
    return None


def first_token_after_neighbour(servers: dict[str, ServerProcess], args) -> None:
    """Round after round, each server in turn: a request on a quiet CPU, then one just after a neighbour that
    ran long enough for the governor to lower; prints each time, when the threads came back, and the medians
    (and the builds' ratio)."""
    times = {name: {"quiet": [], "after": [], "lag": []} for name in servers}
    for server in servers.values():
        first_token_s(server.base_url, args.first_token, 0, args.timeout)  # warm-up
    for r in range(1, args.rounds + 1):
        for i, (name, server) in enumerate(servers.items()):
            seed, t = 100 * r + 10 * i, times[name]
            time.sleep(2)
            t["quiet"].append(first_token_s(server.base_url, args.first_token, seed, args.timeout))
            with busy_neighbour():  # long enough for the governor to lower; the request comes as it stops
                time.sleep(LOWER_AFTER_S + 2)
            sent_at = time.time()
            t["after"].append(first_token_s(server.base_url, args.first_token, seed + 1, args.timeout))
            lag = raise_lag_s(server.log_text(), sent_at, time.time())
            if lag is not None:
                t["lag"].append(lag)
            print(f"round {r} {name}: quiet {t['quiet'][-1]:.2f} s, just after a neighbour {t['after'][-1]:.2f} s "
                  f"(two threads again after {'-' if lag is None else f'{lag:.2f} s'})", flush=True)
    medians = {name: {k: statistics.median(v) if v else float("nan") for k, v in t.items()}
               for name, t in times.items()}
    for name, m in medians.items():
        print(f"{name}: median time to first token of {args.first_token} tokens: quiet {m['quiet']:.2f} s, "
              f"just after a neighbour {m['after']:.2f} s ({m['after'] / m['quiet']:.2f}x); threads back after "
              f"{m['lag']:.2f} s")
    if len(medians) == 2:
        (new, m_new), (old, m_old) = medians.items()
        print(f"just after a neighbour, {new} over {old}: {m_new['after'] / m_old['after']:.2f}x the time "
              f"(quiet: {m_new['quiet'] / m_old['quiet']:.2f}x)")


def start_servers(serve: list[str], baseline: str | None) -> dict[str, ServerProcess]:
    """This checkout's server, and with `baseline` one of that checkout too (started from its folder, which
    `python -m` puts first on the path)."""
    servers = {"this checkout": ServerProcess(*serve)}
    if baseline is not None:
        here = os.getcwd()
        os.chdir(baseline)
        try:
            servers["baseline"] = ServerProcess(*serve)
        except BaseException:
            servers["this checkout"].stop()
            raise
        finally:
            os.chdir(here)
    return servers


def bench(base_url: str, args) -> float:
    """Output tokens/s of one `sobrio bench serve` run (bounded by its prompt count and a timeout)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "sobrio.cli", "bench", "serve", "--base-url", base_url,
                        "--model", served_model(base_url), "--num-prompts", str(args.num_prompts),
                        "--max-concurrency", "16",
                        "--input-len", "64", "--output-len", str(args.output_len), "--ignore-eos", "--no-progress",
                        "--result-json", out.name], check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
        return json.load(open(out.name))["output_throughput"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=48, help="requests per run (default 48)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take (default 300)")
    parser.add_argument("--fixed", action="store_true", help="threads and spin fixed as before issue 40")
    parser.add_argument("--first-token", type=int, metavar="N",
                        help="instead: time to first token of N-token prompts sent as a neighbour stops")
    parser.add_argument("--rounds", type=int, default=5, help="--first-token's pairs (default 5)")
    parser.add_argument("--baseline", help="--first-token: also serve this checkout, in turns with this one")
    parser.add_argument("--model", default="smollm2-135m", help="alias or folder served (default smollm2-135m)")
    args = parser.parse_args()
    max_len = 512 if args.first_token is None else args.first_token + 64
    serve = ["--model", args.model, "--kv-cache-memory", str(256 << 20), "--max-model-len", str(max_len)]
    env_before = {name: os.environ.get(name) for name in ("GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    if args.fixed:
        os.environ["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
        os.environ["GOMP_SPINCOUNT"] = "1000000"
    servers = start_servers(serve, args.baseline if args.first_token is not None else None)
    server = servers["this checkout"]
    try:
        if args.first_token is not None:
            first_token_after_neighbour(servers, args)
            return 0
        bench(server.base_url, argparse.Namespace(**{**vars(args), "num_prompts": 16}))  # warm-up
        idle = bench(server.base_url, args)
        print(f"idle:      {idle:8.1f} output tok/s", flush=True)
        with busy_neighbour():
            time.sleep(LOWER_AFTER_S + 1)  # the governor lowers after LOWER_AFTER_S of looks that see it
            busy = bench(server.base_url, args)
        print(f"neighbour: {busy:8.1f} output tok/s", flush=True)
        print(f"ratio neighbour/idle: {busy / idle:.2f}x ({'fixed threads' if args.fixed else 'cpu_share'})")
    finally:
        for srv in servers.values():
            srv.stop()
            os.unlink(srv.log.name)
        for name, value in env_before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0


if __name__ == "__main__":
    sys.exit(main())
