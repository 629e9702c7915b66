"""Tensor parallelism's cost on this host: TP=2 (two processes, gloo) against one rank, offline, in one run.

For a decode phase (`--batch` requests generating `--tokens` each) and a prefill phase (one `--prompt`-token
prompt), prints tokens/s of both, the step time, and TP=2's collectives per step: all-reduces (two per layer,
plus the embedding's) and the logits' all-gather, bytes each rank puts in per call, microseconds per call as
rank 0 sees them (they include waiting for the slower rank), and their share of the step. Then gloo's own
all-reduce between two idle processes, by size: its latency floor and bandwidth. Those are the figures
`benchmarks/scale_model.py` takes (--step-ms, --allreduce-us, --local-gbs).

    .venv/bin/python benchmarks/tensor_parallel.py [--model smollm2-135m] [--dtype float32] [--batch 32]

On 2 cores both ranks share the memory bandwidth and the cores one rank would use alone: TP=2 cannot be
faster here; the run measures what the split and the collectives cost.
"""

import argparse
import multiprocessing
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sobrio import LLM, SamplingParams  # noqa: E402
from sobrio.distributed.shm_allreduce import ShmAllReduce  # noqa: E402


def counting_steps(llm: LLM) -> list[float]:
    """Wrap the executor so each step's seconds are recorded."""
    executor, times = llm.engine.core.executor, []
    execute = executor.execute

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = execute(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return result
    executor.execute = timed
    return times


def snapshot(llm: LLM) -> dict:
    group = getattr(llm.engine.core.executor, "group", None)
    if group is None:
        return {}
    return {kind: (s.calls, s.bytes, s.seconds) for kind, s in group.stats.items()}


def phase(llm: LLM, prompts: list, params: SamplingParams) -> dict:
    times = counting_steps(llm)
    before = snapshot(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = snapshot(llm)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs) if params.max_tokens > 1 else \
        sum(len(o.prompt_token_ids) for o in outputs)
    result = {"tokens_per_s": tokens / wall, "steps": len(times), "step_ms": 1000 * sum(times) / len(times),
              "step_s": sum(times)}
    for kind in after:
        calls, nbytes, seconds = (a - b for a, b in zip(after[kind], before[kind]))
        result[kind] = {"per_step": calls / len(times), "bytes": nbytes / max(calls, 1),
                        "us": 1e6 * seconds / max(calls, 1), "share": seconds / sum(times)}
    return result


def run(model: str, tp: int, args) -> dict:
    with LLM(model, dtype=args.dtype, tensor_parallel_size=tp, kv_cache_memory=512 << 20, max_model_len=2048,
             enable_prefix_caching=False) as llm:
        ids = list(range(1000, 1000 + args.prompt))
        decode = phase(llm, [f"Request {i} tells a story:" for i in range(args.batch)],
                       SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True))
        prefill = phase(llm, [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0))
    return {"decode": decode, "prefill": prefill}


def report(name: str, one: dict, two: dict) -> None:
    ratio = two["tokens_per_s"] / one["tokens_per_s"]
    print(f"\n{name}: TP=1 {one['tokens_per_s']:.0f} tok/s ({one['step_ms']:.2f} ms/step), TP=2 "
          f"{two['tokens_per_s']:.0f} tok/s ({two['step_ms']:.2f} ms/step): {ratio:.2f}x")
    for kind in ("all_reduce", "all_gather"):
        c = two[kind]
        print(f"  {kind:10s} {c['per_step']:5.1f} per step, {c['bytes'] / 1024:8.1f} KiB each, {c['us']:7.1f} us "
              f"each ({c['bytes'] / max(c['us'], 1e-9) / 1e3:.2f} GB/s), {100 * c['share']:.1f}% of the step")


def _all_reduce_rank(rank: int, port: int, sizes: list[int], results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    shm = ShmAllReduce(0, 2) if rank == 0 else None
    box = [shm.name if shm else None]
    dist.broadcast_object_list(box, src=0)
    shm = shm or ShmAllReduce(rank, 2, box[0])
    for name, reduce in (("gloo", dist.all_reduce), ("shared memory", shm.all_reduce)):
        for size in sizes:
            tensor = torch.ones(size // 4)
            repeats = max(5, min(200, (64 << 20) // size))
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats):
                reduce(tensor)
            if rank == 0:
                results.put((name, size, (time.perf_counter() - start) / repeats))
    dist.barrier()
    shm.close()
    dist.destroy_process_group()


def all_reduce_sweep(sizes: list[int]) -> list[tuple[str, int, float]]:
    """gloo's and the shared-memory all-reduce between two processes on this host: (path, bytes, seconds)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_all_reduce_rank, args=(r, port, sizes, results)) for r in range(2)]
    for r in ranks:
        r.start()
    found = [results.get(timeout=300) for _ in range(2 * len(sizes))]
    for r in ranks:
        r.join(30)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=1024)
    args = parser.parse_args()
    one, two = run(args.model, 1, args), run(args.model, 2, args)
    print(f"{args.model} {args.dtype}: decode {args.batch} x {args.tokens} tokens; prefill one {args.prompt}-token "
          f"prompt (2 processes on this host)")
    report(f"decode batch {args.batch}", one["decode"], two["decode"])
    report(f"prefill {args.prompt} tokens", one["prefill"], two["prefill"])
    print("\nall-reduce between 2 idle processes on this host (float32): gloo (TCP) and shared memory (TP's path)")
    sweep = all_reduce_sweep([4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20])
    for name in ("gloo", "shared memory"):
        rows = [(size, seconds) for path, size, seconds in sweep if path == name]
        for size, seconds in rows:
            print(f"  {name:13s} {size / 1024:7.0f} KiB: {1e6 * seconds:8.1f} us ({size / seconds / 1e9:.2f} GB/s)")
        latency, (big, big_s) = rows[0][1], rows[-1]
        print(f"  -> scale_model.py --allreduce-us {1e6 * latency:.0f} --local-gbs "
              f"{big / max(big_s - latency, 1e-9) / 1e9:.2f}")


if __name__ == "__main__":
    main()
