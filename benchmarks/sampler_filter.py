"""Top-p/top-k filtering: the nucleus looked for among each row's best 256 tokens (sobrio's sampler) against
sorting every row whole (its previous form, and the definition), one core, same run.

    .venv/bin/python benchmarks/sampler_filter.py [--rows 300]
"""

import argparse
import time

import torch

from sobrio.sample.sampler import _keep_top_k_top_p, filter_top_k_top_p_min_p


def seconds(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for vocab, name in ((49152, "SmolLM2"), (262144, "Gemma 3")):
        report(name, vocab, args.rows)


def peaked_logits(rows: int, vocab: int) -> torch.Tensor:
    """A model's rows are peaked: a few dozen likely tokens above a long flat tail."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=generator)
    likely = torch.randint(0, vocab, (rows, 32), generator=generator)
    return logits.scatter_add_(1, likely, 12 + 3 * torch.randn(rows, 32, generator=generator))


def report(name: str, vocab: int, rows: int) -> None:
    logits = peaked_logits(rows, vocab)
    k, p = torch.full((rows, 1), vocab), torch.full((rows, 1), 0.9)
    whole = seconds(lambda: _keep_top_k_top_p(logits, k, p, vocab))
    fast = seconds(lambda: filter_top_k_top_p_min_p(logits, [0] * rows, [0.9] * rows, [0.0] * rows))
    print(f"{name} vocabulary ({vocab}), {rows} rows, top_p 0.9: whole-row sort {whole * 1e3:.0f} ms, "
          f"best-256 first {fast * 1e3:.0f} ms ({whole / fast:.1f}x)")

if __name__ == "__main__":
    main()
