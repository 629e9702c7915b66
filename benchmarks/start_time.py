"""Start to first token of `sobrio serve`, two checkouts side by side (issue 43): each start is a fresh
`python -m sobrio.cli serve MODEL` of one checkout (its folder first on the path), polled with one greedy
1-token completion until it answers; the checkouts alternate, so a busy host slows both alike. The model's
files are read once before (warm page cache). Prints each start's seconds, the median of each checkout and the
ratio, with the CPU's name and the load average before and after.

    .venv/bin/python benchmarks/start_time.py MODEL --baseline /path/to/old/checkout [--candidate .]
        [--rounds 3] [--kv-cache-memory BYTES]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quantization_start import avx512_flags, cpu_name  # noqa: E402

POLL_S = 0.05
TIMEOUT_S = 600.0


def warm(model: str) -> None:
    """The model's files read once, so each start reads them from the page cache."""
    from sobrio.loader.resolve import resolve_model

    path = resolve_model(model).path
    path = path if path.is_file() else path.parent if path.suffix == ".gguf" else path
    for file in ([path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())):
        with open(file, "rb") as f:
            while f.read(1 << 24):
                pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_token(port: int, name: str) -> bool:
    body = json.dumps({"model": name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return bool(json.loads(response.read())["choices"])
    except OSError:
        return False


def one_start(checkout: Path, model: str, kv_bytes: int) -> float:
    """Seconds from spawning `sobrio serve` to its first answered token; the server is stopped after."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(checkout))
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "sobrio.cli", "serve", model, "--host", "127.0.0.1",
                               "--port", str(port), "--kv-cache-memory", str(kv_bytes), "--max-model-len", "1024",
                               "--log-level", "warning"], cwd=checkout, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while not first_token(port, model if "/" not in model else Path(model).name):
            if server.poll() is not None:
                raise RuntimeError(f"{checkout}: server exited {server.returncode}: {server.stderr.read()[-2000:]}")
            if time.perf_counter() - started > TIMEOUT_S:
                raise RuntimeError(f"{checkout}: no first token after {TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
        return time.perf_counter() - started
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model folder (or .gguf file)")
    parser.add_argument("--baseline", required=True, help="the checkout to compare against (e.g. main's)")
    parser.add_argument("--candidate", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    args = parser.parse_args()
    checkouts = {"baseline": Path(args.baseline).resolve(), "candidate": Path(args.candidate).resolve()}
    warm(args.model)
    print(f"CPU: {cpu_name()} ({avx512_flags()}), {os.cpu_count()} CPUs; load average before {os.getloadavg()[0]:.2f}; "
          f"model {args.model}", flush=True)
    seconds: dict[str, list[float]] = {name: [] for name in checkouts}
    for round_ in range(args.rounds):
        for name, checkout in checkouts.items():
            seconds[name].append(one_start(checkout, args.model, args.kv_cache_memory))
            print(f"round {round_ + 1} {name} ({checkout}): first token {seconds[name][-1]:.2f} s "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"median start to first token: baseline {medians['baseline']:.2f} s, candidate {medians['candidate']:.2f} s "
          f"({medians['baseline'] / medians['candidate']:.2f}x faster); load average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
