"""Serving throughput of the scale-out layouts on this host, one after another in one run: one engine core,
two data-parallel replicas (`--data-parallel-size 2`), prefill and decode disaggregated
(`--kv-transfer-config`), and tensor parallelism (`--tensor-parallel-size 2`), each loaded by
`sobrio bench serve` with the same requests (all at once). Prints output tokens/s, TTFT and TPOT medians,
and each layout's ratio to one core.

    .venv/bin/python benchmarks/scale_out_serving.py [--model smollm2-135m] [--num-prompts 64]

On 2 cores expect DP=2 near 1x: both replicas share the two cores and the memory bandwidth that one core's
batch already uses (a batch of 32 decodes reads the weights once per step for all of them).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"one core": [], "DP=2": ["--data-parallel-size", "2"],
           "prefill/decode (shm)": ["--kv-transfer-config", '{"kv_connector": "SharedMemoryConnector"}'],
           "TP=2": ["--tensor-parallel-size", "2"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, flags: list[str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sobrio.cli", "serve", "--model", model, "--port", str(port),
           "--kv-cache-memory", str(512 << 20), "--max-model-len", "2048", "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server with {flags} exited ({proc.returncode})")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server with {flags} did not start")


def bench(model: str, port: int, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "sobrio.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                        "--model", model, "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                        "--output-len", str(args.output_len), "--ignore-eos", "--no-progress", "--result-json",
                        out.name], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        return json.load(open(out.name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    args = parser.parse_args()
    print(f"{args.model}: {args.num_prompts} requests at once, {args.input_len} prompt + {args.output_len} output "
          f"tokens, {os.cpu_count()} CPUs")
    base = None
    for name in args.layouts:
        port = free_port()
        proc = serve(args.model, LAYOUTS[name], port)
        try:
            result = bench(args.model, port, args)
        finally:
            proc.terminate()
            proc.wait(60)
        rate = result["output_throughput"]
        base = base or rate
        print(f"  {name:22s} {rate:7.1f} output tok/s ({rate / base:.2f}x), TTFT p50 "
              f"{result['median_ttft_ms']:7.0f} ms, TPOT p50 {result['median_tpot_ms']:6.1f} ms, "
              f"{result['failed']} failed")


if __name__ == "__main__":
    main()
