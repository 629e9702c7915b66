"""Offline throughput: the same mixed-length requests through sobrio and through transformers' batched
`generate` at each of several batch sizes (same model, same dtype, same dense weights); prints output
and total tokens/s for each and sobrio's ratio to transformers' best.

    .venv/bin/python benchmarks/offline_throughput.py [--num-prompts 128] [--hf-batch-sizes 16,32,64]

Requests: prompts of 32-512 random tokens, outputs of 32-256 tokens, both drawn per request from a
fixed seed; EOS ignored so every request produces exactly its length. transformers' static batches
must all run to their longest request: it gets the requests sorted by output length (its best case),
and only the tokens each request asked for are counted.
"""

import argparse
import random
import time

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch

from sobrio import LLM, SamplingParams
from sobrio.loader.load import load_model_files


def make_requests(count: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs; random ids, so no two prompts share a prefix."""
    rng = random.Random(seed)
    return [([rng.randrange(200, 20000) for _ in range(rng.randint(*input_range))], rng.randint(*output_range))
            for _ in range(count)]


def run_sobrio(args, requests) -> float:
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    llm.generate([{"prompt_token_ids": requests[0][0]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in requests]
    return elapsed


def run_transformers(model, requests, batch_size: int) -> float:
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ordered = sorted(requests, key=lambda r: r[1])
    start = time.perf_counter()
    for i in range(0, len(ordered), batch_size):
        batch = ordered[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad)
    return time.perf_counter() - start


def model_dtype(args) -> torch.dtype:
    from sobrio.models.sizing import resolve_dtype

    return resolve_dtype(args.dtype)


def report(name: str, elapsed: float, requests) -> float:
    out = sum(n for _, n in requests)
    total = out + sum(len(p) for p, _ in requests)
    print(f"{name:<24} {out / elapsed:8.1f} output tok/s {total / elapsed:8.1f} total tok/s  ({elapsed:.1f} s)",
          flush=True)
    return out / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", default="32-512", help="min-max prompt tokens")
    parser.add_argument("--output-len", default="32-256", help="min-max output tokens")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--hf-batch-sizes", default="16,32,64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    span = lambda text: tuple(int(x) for x in text.split("-"))
    requests = make_requests(args.num_prompts, span(args.input_len), span(args.output_len), args.seed)
    print(f"model={args.model} dtype={model_dtype(args)} requests={len(requests)} input={args.input_len} "
          f"output={args.output_len} threads={torch.get_num_threads()}")
    ours = report("sobrio", run_sobrio(args, requests), requests)
    if args.skip_transformers:
        return
    from transformers import AutoModelForCausalLM

    # Dense weights, exactly sobrio's: transformers' own GGUF load keeps them quantized (slower matmuls).
    folder = load_model_files(args.model).folder
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=model_dtype(args)).eval()
    best = max(report(f"transformers batch {size}", run_transformers(model, requests, size), requests)
               for size in map(int, args.hf_batch_sizes.split(",")))
    print(f"ratio sobrio / transformers' best: {ours / best:.2f}x")


if __name__ == "__main__":
    main()
