"""Greedy sampling of a decode step's logits: torch.max(dim=-1) against the C++ `argmax_rows` (both threads),
on float32 logits [rows, vocab] just written (as the LM head leaves them), same run.

    .venv/bin/python benchmarks/greedy_argmax.py [--rows 32] [--vocab 49152]
"""

import argparse
import time

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402

from sobrio.layers.cpu_ops import cpu_ops  # noqa: E402


def per_call_us(fn, logits: torch.Tensor, source: torch.Tensor, repeats: int) -> float:
    """Microseconds of `fn(logits)` after each rewrite of the logits (the rewrite not counted)."""
    total = 0.0
    for _ in range(repeats):
        logits.copy_(source)
        start = time.perf_counter()
        fn(logits)
        total += time.perf_counter() - start
    return total / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    ops = cpu_ops()
    assert ops is not None, "the C++ operators did not build"
    source = torch.randn(args.rows, args.vocab)
    logits = torch.empty_like(source)
    logits.copy_(source)
    assert torch.equal(ops.argmax_rows(logits), logits.max(dim=-1).indices)
    for _ in range(2):  # the second round is the one to read: both warmed up
        aten = per_call_us(lambda x: x.max(dim=-1).indices, logits, source, args.repeats)
        cpp = per_call_us(ops.argmax_rows, logits, source, args.repeats)
    print(f"[{args.rows}, {args.vocab}] float32, {torch.get_num_threads()} threads: torch.max {aten:.0f} us, "
          f"argmax_rows {cpp:.0f} us, {aten / cpp:.1f}x")


if __name__ == "__main__":
    main()
