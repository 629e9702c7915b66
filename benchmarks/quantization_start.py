"""Start to first token of a quantized model, first start against later ones (issue 43): each start is a fresh
process (`LLM(folder, quantization=M)` then one greedy token), run one after the other against one
quantization cache folder, so the first quantizes (and writes the cache, where the cache is on) and the
next reads what it wrote. Prints each start's seconds and the ratio first / second, with the CPU's name.

    .venv/bin/python benchmarks/quantization_start.py FOLDER --quantization int8 [--starts 2]
        [--cache-dir DIR | --cache off] [--kv-cache-memory BYTES]
"""

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from sobrio import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(args["model"], **args["kwargs"])
t1 = time.perf_counter()
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM")))
print(json.dumps({"load_s": t1 - t0, "first_token_s": time.perf_counter() - t0,
                  "token": out[0].outputs[0].token_ids, "rss_gb": int(status["VmRSS"].split()[0]) / 1e6,
                  "peak_gb": int(status["VmHWM"].split()[0]) / 1e6}))
"""


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def avx512_flags() -> str:
    """The flags that choose the quantized kernels (AVX512-VNNI, AMX): what sets the layouts and the speed."""
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return " ".join(f for f in flags if f.startswith(("avx512_vnni", "avx512_bf16", "amx"))) or "no VNNI/AMX"


def one_start(model: str, kwargs: dict) -> dict:
    """One start in a fresh process: its seconds to the loaded engine and to the first token, and the token."""
    wall = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"model": model, "kwargs": kwargs})],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"start failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result | {"process_s": time.perf_counter() - wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--quantization", default="int8", help="int8, int8-weight-only, int4, gguf (a .gguf "
                        "model), or none (bf16: a warm start without quantizing, for comparison)")
    parser.add_argument("--starts", type=int, default=2)
    parser.add_argument("--cache-dir", default=None, help="the quantization cache (default: a new empty folder)")
    parser.add_argument("--cache", choices=("on", "off"), default="on")
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    args = parser.parse_args()
    cache = "off" if args.cache == "off" else (args.cache_dir or tempfile.mkdtemp(prefix="sobrio-qcache-"))
    kwargs = dict(quantization=None if args.quantization == "none" else args.quantization,
                  kv_cache_memory=args.kv_cache_memory, max_model_len=1024, quantization_cache=cache)
    print(f"CPU: {cpu_name()} ({avx512_flags()}); model {args.model}; --quantization {args.quantization}; "
          f"cache {cache}", flush=True)
    starts = []
    for i in range(args.starts):
        starts.append(one_start(args.model, kwargs))
        s = starts[-1]
        print(f"start {i + 1}: engine loaded {s['load_s']:.1f} s, first token {s['first_token_s']:.1f} s "
              f"(process {s['process_s']:.1f} s), token {s['token']}, resident {s['rss_gb']:.2f} GB "
              f"(peak {s['peak_gb']:.2f})", flush=True)
    if len(starts) > 1:
        print(f"first / second start to first token: {starts[0]['first_token_s'] / starts[1]['first_token_s']:.1f}x; "
              f"same token: {starts[0]['token'] == starts[1]['token']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
