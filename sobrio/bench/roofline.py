"""`sobrio bench roofline`: this machine's peak matmul FLOP/s (bf16, fp32) and memory bandwidth, and the
share of each an engine decode step reaches: bandwidth at small batches (weights + KV read per step),
FLOP/s at large ones."""

import time

import torch


def _best_time(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def peak_matmul_flops(dtype: torch.dtype, n: int = 2048) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / _best_time(lambda: torch.mm(a, b))


def memory_bandwidth(gib: float = 1.0) -> float:
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    return x.numel() * 4 / _best_time(lambda: x.sum())


def decode_step_time(llm, batch: int, prompt_len: int, steps: int = 8) -> tuple[float, int]:
    """Mean time of a pure decode step at this batch size, and the KV tokens it reads."""
    from sobrio import SamplingParams

    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"roofline-{batch}-{i}", None, SamplingParams(max_tokens=steps + 64, ignore_eos=True),
                           prompt_token_ids=[100 + (i + j) % 1000 for j in range(prompt_len)])
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    kv_tokens = sum(r.num_computed_tokens for r in engine.scheduler.running)
    for i in range(batch):
        engine.abort_request(f"roofline-{batch}-{i}")
    return elapsed, kv_tokens


def add_roofline_args(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", default="1,64", help="decode batch sizes to place on the roofline")
    parser.add_argument("--prompt-len", type=int, default=128)


def cmd_bench_roofline(args) -> int:
    from sobrio import LLM

    bf16, fp32, bandwidth = peak_matmul_flops(torch.bfloat16), peak_matmul_flops(torch.float32), memory_bandwidth()
    print(f"machine: bf16 matmul {bf16 / 1e12:.2f} TFLOP/s, fp32 matmul {fp32 / 1e12:.2f} TFLOP/s, "
          f"memory read {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")
    llm = LLM(args.model, dtype=args.dtype)
    runner = llm.engine.runner
    params = sum(p.numel() for p in runner.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_bytes_per_token = runner.kv_spec.token_bytes
    peak = bf16 if runner.dtype == torch.bfloat16 else fp32
    print(f"model {args.model}: {params / 1e6:.0f} M parameters, {weight_bytes / 1e6:.0f} MB of weights "
          f"({runner.dtype}), {kv_bytes_per_token} B of KV per token")
    for batch in [int(b) for b in args.batch.split(",")]:
        step, kv_tokens = decode_step_time(llm, batch, args.prompt_len)
        moved = weight_bytes + kv_tokens * kv_bytes_per_token
        flops = 2 * params * batch
        floor = max(moved / bandwidth, flops / peak)
        print(f"batch {batch:3}: step {step * 1000:7.1f} ms (floor {floor * 1000:6.1f} ms) "
              f"{batch / step:7.1f} tok/s | bandwidth {moved / step / 1e9:5.1f} GB/s = {moved / step / bandwidth:5.1%} "
              f"of peak | compute {flops / step / 1e12:5.3f} TFLOP/s = {flops / step / peak:5.1%} of peak")
    return 0
