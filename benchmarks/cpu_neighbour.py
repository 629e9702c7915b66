"""Throughput at 16 in flight with an idle CPU and beside a one-core busy neighbour, and their ratio.

    python benchmarks/cpu_neighbour.py            # ~2-4 min on 2 cores; prints idle, neighbour, ratio
    python benchmarks/cpu_neighbour.py --fixed     # the same with the threads and spin fixed as before issue 40

It starts `sobrio serve` (SmolLM2, bf16), runs `sobrio bench serve` (random prompts, 16 in flight, fixed
output length) on an idle CPU, then again while it runs a neighbour of its own (a Python busy loop, one
core), stops it, and prints output tokens/s of both runs and neighbour/idle. `--fixed` starts the server
with `--num-threads` = all cores and the long OpenMP spin, the policy before `engine/cpu_share.py`.
A quiet host is needed for a figure worth quoting: other processes are neighbours too.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.server.conftest import ServerProcess  # noqa: E402 - the server harness of the tests

NEIGHBOUR = "import time\nend = time.monotonic() + 900\nwhile time.monotonic() < end:\n    pass\n"


def bench(base_url: str, args) -> float:
    """Output tokens/s of one `sobrio bench serve` run (bounded by its prompt count and a timeout)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "sobrio.cli", "bench", "serve", "--base-url", base_url,
                        "--model", "smollm2-135m", "--num-prompts", str(args.num_prompts), "--max-concurrency", "16",
                        "--input-len", "64", "--output-len", str(args.output_len), "--ignore-eos", "--no-progress",
                        "--result-json", out.name], check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
        return json.load(open(out.name))["output_throughput"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=48, help="requests per run (default 48)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take (default 300)")
    parser.add_argument("--fixed", action="store_true", help="threads and spin fixed as before issue 40")
    args = parser.parse_args()
    serve = ["--model", "smollm2-135m", "--kv-cache-memory", str(256 << 20), "--max-model-len", "512"]
    env_before = os.environ.get("GOMP_SPINCOUNT")
    if args.fixed:
        serve += ["--num-threads", str(len(os.sched_getaffinity(0)))]
        os.environ["GOMP_SPINCOUNT"] = "1000000"
    server = ServerProcess(*serve)
    neighbour = None
    try:
        bench(server.base_url, argparse.Namespace(**{**vars(args), "num_prompts": 16}))  # warm-up
        idle = bench(server.base_url, args)
        print(f"idle:      {idle:8.1f} output tok/s", flush=True)
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR])
        time.sleep(3)  # the governor looks once a second and changes after two looks
        busy = bench(server.base_url, args)
        print(f"neighbour: {busy:8.1f} output tok/s", flush=True)
        print(f"ratio neighbour/idle: {busy / idle:.2f}x ({'fixed threads' if args.fixed else 'cpu_share'})")
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
        server.stop()
        os.unlink(server.log.name)
        if env_before is None:
            os.environ.pop("GOMP_SPINCOUNT", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
