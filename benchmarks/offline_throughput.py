"""Offline throughput: the same mixed-length requests through sobrio and through transformers' batched
`generate` (same model, same dtype); prints output tokens/s for each and their ratio.

    .venv/bin/python benchmarks/offline_throughput.py [--model smollm2-135m] [--num-prompts 64]
"""

import argparse
import os
import random
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from sobrio import LLM, SamplingParams
from sobrio.loader.load import load_model_files


def make_prompts(tokenizer, count: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """Random token prompts of mixed lengths, each starting differently (no shared prefix to cache)."""
    rng = random.Random(seed)
    vocab = [i for i in range(200, min(tokenizer.vocab_size, 20000))]
    return [[rng.choice(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def run_sobrio(args, prompts) -> tuple[float, int]:
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def run_transformers(args, prompts) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    # Dense weights, exactly sobrio's: transformers' own GGUF load keeps them quantized (slower matmuls).
    folder = load_model_files(args.model).folder
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=LLM_dtype(args)).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    start, produced = time.perf_counter(), 0
    for i in range(0, len(prompts), args.hf_batch_size):
        batch = prompts[i:i + args.hf_batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
        produced += (out.shape[1] - width) * len(batch)
    return time.perf_counter() - start, produced


def LLM_dtype(args) -> torch.dtype:
    from sobrio.engine.model_runner import resolve_dtype

    return resolve_dtype(args.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input-len", type=int, default=16)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    tokenizer = load_model_files(args.model).tokenizer
    prompts = make_prompts(tokenizer, args.num_prompts, args.min_input_len, args.max_input_len, args.seed)
    print(f"model={args.model} dtype={LLM_dtype(args)} requests={len(prompts)} "
          f"input={args.min_input_len}-{args.max_input_len} output={args.output_len} threads={torch.get_num_threads()}")
    s_time, s_tokens = run_sobrio(args, prompts)
    print(f"sobrio:       {s_tokens / s_time:8.1f} output tok/s  ({s_tokens} tokens in {s_time:.1f} s)")
    if args.skip_transformers:
        return
    h_time, h_tokens = run_transformers(args, prompts)
    print(f"transformers: {h_tokens / h_time:8.1f} output tok/s  ({h_tokens} tokens in {h_time:.1f} s, "
          f"batch {args.hf_batch_size})")
    print(f"ratio sobrio / transformers: {(s_tokens / s_time) / (h_tokens / h_time):.2f}x")


if __name__ == "__main__":
    main()
