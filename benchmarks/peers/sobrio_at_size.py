"""sobrio's side of issue 43's comparisons on one model folder: start time (spawn to /health, then to the first
token), the engine core's resident memory (and its peak), batch-1 decode tok/s and time to first token at 1,000
and 4,000 prompt tokens through HTTP (`sobrio bench serve`), then `sobrio bench roofline --batch 1,16,32` for
each step's share of the memory bandwidth measured on this machine. Prints one summary and writes it as JSON.

    .venv/bin/python benchmarks/peers/sobrio_at_size.py FOLDER [--port 8000] [--result-json F] [serve flags...]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 1200) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}) before answering")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"no answer from {url} in {timeout:.0f} s")


def first_token(base: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=600).read()


def resident(pid: int) -> dict[str, float]:
    """The largest child's (the engine core's) VmRSS and VmHWM in GB."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    best = {"rss_gb": 0.0, "peak_gb": 0.0}
    for child in out:
        status = Path(f"/proc/{child}/status").read_text()
        fields = {line.split(":")[0]: int(line.split()[1]) / 1e6 for line in status.splitlines()
                  if line.startswith(("VmRSS", "VmHWM"))}
        if fields.get("VmRSS", 0) > best["rss_gb"]:
            best = {"rss_gb": fields["VmRSS"], "peak_gb": fields["VmHWM"]}
    return best


def bench(base: str, model: str, folder: str, result: Path, *flags: str) -> dict:
    subprocess.run([str(BIN / "sobrio"), "bench", "serve", "--base-url", base, "--model", model, "--tokenizer", folder,
                    "--ignore-eos", "--no-progress", "--max-concurrency", "1", "--result-json", str(result), *flags],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


def serve_figures(args, extra: list[str]) -> dict:
    base, model = f"http://127.0.0.1:{args.port}", Path(args.folder).name
    start = time.monotonic()
    log = open(args.result_json.with_suffix(".serve.log") if args.result_json else os.devnull, "w")  # no prompt text
    server = subprocess.Popen([str(BIN / "sobrio"), "serve", args.folder, "--port", str(args.port), *extra],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"{base}/health", server)
        ready = time.monotonic() - start
        first_token(base, model)
        figures = {"start_s": round(ready, 1), "start_to_first_token_s": round(time.monotonic() - start, 1)}
        figures |= resident(server.pid)
        with tempfile.TemporaryDirectory() as tmp:
            one = bench(base, model, args.folder, Path(tmp) / "b1.json", "--num-prompts", str(args.batch1_prompts),
                        "--input-len", "80", "--output-len", str(args.batch1_tokens), "--seed", "1")
            figures["batch1_tok_s"] = round(one["output_throughput"], 2)
            for length in args.ttft_lengths:  # a failure is recorded, the figures so far kept; prompts of a
                # seed of their own: with one seed the 4,000-token prompts began as the 1,000-token ones, and
                # 992 of their tokens came from the prefix cache
                try:
                    r = bench(base, model, args.folder, Path(tmp) / f"t{length}.json", "--num-prompts", "2",
                              "--input-len", str(length), "--output-len", "2", "--seed", str(length))
                    figures[f"ttft_{length}_ms"] = round(r["p50_ttft_ms"])
                except subprocess.CalledProcessError as exc:
                    figures[f"ttft_{length}_ms"] = f"failed (exit {exc.returncode})"
        figures |= {f"after_bench_{k}": v for k, v in resident(server.pid).items()}
        return figures
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def roofline(folder: str, extra: list[str]) -> list[str]:
    quantization = extra[extra.index("--quantization") + 1:][:1] if "--quantization" in extra else []
    env = dict(os.environ)
    if "--quantization-cache" in extra:  # the server's cache folder, not the default one (an entry per folder)
        env["SOBRIO_QUANTIZATION_CACHE"] = extra[extra.index("--quantization-cache") + 1]
    out = subprocess.run([str(BIN / "sobrio"), "bench", "roofline", "--model", folder, "--batch", "1,16,32",
                          *(["--quantization", *quantization] if quantization else [])],
                         capture_output=True, text=True, env=env)
    if out.returncode:  # recorded beside the server's figures, which are kept
        return [f"failed (exit {out.returncode}): {(out.stderr.strip().splitlines() or [''])[-1]}"]
    return [line for line in out.stdout.splitlines() if line.startswith(("machine", "model", "batch"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--no-roofline", action="store_true", help="skip `sobrio bench roofline`")
    parser.add_argument("--batch1-prompts", type=int, default=4, help="batch-1 requests (default %(default)s)")
    parser.add_argument("--batch1-tokens", type=int, default=64, help="tokens each batch-1 request decodes")
    parser.add_argument("--ttft-lengths", type=int, nargs="*", default=[1000, 4000],
                        help="prompt lengths whose time to first token is measured (default %(default)s)")
    args, extra = parser.parse_known_args()
    figures = {"cpu": cpu_name(), "cores": os.cpu_count(), "model": args.folder, "flags": extra}
    figures |= serve_figures(args, extra)
    if not args.no_roofline:
        figures["roofline"] = roofline(args.folder, extra)
    print(json.dumps(figures, indent=1))
    if args.result_json:
        args.result_json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
