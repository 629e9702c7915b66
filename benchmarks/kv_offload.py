"""KV offload tiers, offline on one model: time to first token for a ~2,000-token shared prompt cold, from
the pool, from the RAM tier, from the disk tier, and from disk after a restart (a new engine on the same
directory); sealing throughput (AES-256-GCM, GB/s and microseconds per block) and the block copy; and output
tokens/s with the tiers on (RAM and disk; blocks reach the disk when the engine idles, evicted from RAM, or
at close) against off, 32 requests in flight.

    .venv/bin/python benchmarks/kv_offload.py [--model smollm2-135m] [--repeats 3]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("SOBRIO_KV_MASTER_KEY", os.urandom(32).hex())  # this run's: never printed

from sobrio import LLM, SamplingParams  # noqa: E402
from sobrio.kv.sealing import TenantKeys, seal, tenant_digest, unseal  # noqa: E402

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)
SCRATCH = tempfile.TemporaryDirectory(prefix="sobrio-kv-offload-")  # the disk tiers' folders: removed at exit


def shared_prompt(llm: LLM, tokens: int) -> str:
    text = resources.files("sobrio.data").joinpath("heldout_alice_in_wonderland.txt").read_text()
    ids = llm.get_tokenizer()(text)["input_ids"][:tokens]
    return llm.get_tokenizer().decode(ids)


def ttft(llm: LLM, prompt: str) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate([prompt], FIRST_TOKEN, use_tqdm=False)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def engine(model: str, folder: str, tiers: bool, pool_mb: int) -> LLM:
    extra = {"kv_offload_ram": 1 << 30, "kv_offload_disk": 4 << 30, "kv_offload_dir": folder} if tiers else {}
    return LLM(model, kv_cache_memory=pool_mb << 20, max_model_len=4096, **extra)


def push_out(llm: LLM, prompt: str) -> None:
    """Fill the pool with other prompts, so the shared one's blocks are evicted (to the RAM tier)."""
    for k in range(4):
        llm.generate([f"Unrelated {k}. " * 300], FIRST_TOKEN, use_tqdm=False)


def measure_ttft(model: str, tokens: int, repeats: int) -> None:
    folder = tempfile.mkdtemp(prefix="sobrio-kv-offload-", dir=SCRATCH.name)
    llm = engine(model, folder, True, 128)
    base = shared_prompt(llm, tokens)
    prompts = [f"Variant {r}. {base}" for r in range(repeats)]
    cold, pool, ram, disk = [], [], [], []
    for prompt in prompts:
        cold.append(ttft(llm, prompt))
        pool.append(ttft(llm, prompt))
        push_out(llm, prompt)
        ram.append(ttft(llm, prompt))
        push_out(llm, prompt)
        llm.engine.core.offload.flush()
        with llm.engine.core.offload.lock:
            llm.engine.core.offload.ram.clear()  # only the disk tier holds it now
        disk.append(ttft(llm, prompt))
    llm.engine.core.close()
    restarted = engine(model, folder, True, 128)
    push_out(restarted, "")  # warm-up, as the cold runs had: long prompts of other text
    restarted.engine.core.offload.flush()  # their disk writes done (a writer busy meanwhile slows the reads)
    after = [ttft(restarted, p) for p in prompts]
    restarted.engine.core.close()
    cold_s = statistics.median(t for t, _ in cold)
    print(f"TTFT, {model}, a {tokens}-token shared prompt, median of {repeats}:")
    for name, runs in (("cold", cold), ("from the pool", pool), ("from the RAM tier", ram),
                       ("from the disk tier", disk), ("from disk after a restart", after)):
        t = statistics.median(s for s, _ in runs)
        print(f"  {name:<26} {t * 1e3:8.1f} ms  ({cold_s / t:5.1f}x faster than cold; cached tokens "
              f"{min(c for _, c in runs)}-{max(c for _, c in runs)})")


def measure_sealing(block_nbytes: int) -> None:
    keys = TenantKeys(os.urandom(32))
    cipher = keys.cipher(tenant_digest("bench"), create=True)
    data, header = os.urandom(block_nbytes), b"h" * 72
    blobs = []
    start = time.perf_counter()
    for _ in range(200):
        blobs.append(seal(cipher, data, header))
    sealed = (time.perf_counter() - start) / 200
    start = time.perf_counter()
    for blob in blobs:
        unseal(cipher, blob, header)
    opened = (time.perf_counter() - start) / 200
    print(f"AES-256-GCM on {block_nbytes}-byte blocks: seal {block_nbytes / sealed / 1e9:.2f} GB/s "
          f"({sealed * 1e6:.0f} us a block), open {block_nbytes / opened / 1e9:.2f} GB/s ({opened * 1e6:.0f} us)")


def measure_throughput(model: str, requests: int, pairs: int = 5) -> None:
    prompts = [f"Request {i}: " + "tell me a long story about the sea and the ships " * 8 for i in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(pairs):
        for tiers in (False, True):
            llm = engine(model, tempfile.mkdtemp(prefix="sobrio-kv-offload-", dir=SCRATCH.name), tiers, 256)
            llm.generate(prompts[:4], params, use_tqdm=False)  # warm
            if tiers:
                llm.engine.core.offload.flush()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[tiers].append(tokens / (time.perf_counter() - start))
            if tiers:
                llm.engine.core.close()
                block_nbytes = llm.engine.core.offload.codec.block_nbytes
    ratios = sorted(on / off for off, on in zip(rates[False], rates[True]))
    print(f"{requests} requests in flight, 64 output tokens each, {pairs} pairs run back to back: tiers off "
          f"{statistics.median(rates[False]):.0f} tok/s, tiers on (RAM + disk) {statistics.median(rates[True]):.0f} "
          f"tok/s (medians); on/off per pair: median {statistics.median(ratios):.3f}x, range "
          f"{ratios[0]:.3f}-{ratios[-1]:.3f}")
    measure_sealing(block_nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    measure_ttft(args.model, args.tokens, args.repeats)
    measure_throughput(args.model, args.requests)


if __name__ == "__main__":
    main()
