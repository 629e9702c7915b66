"""The sampler on a decode batch's logits at a real vocabulary: the C++ `sample_rows` against the PyTorch path
beside it (`sobrio/sample/sampler.py`, run with the operators hidden), in one run, for greedy, temperature,
top-p and top-k rows; on flat rows (a random-weight model's) and peaked ones (a trained model's: a Zipf-like
row, logit = -1.1 ln(rank), in a random order). Then a speculative verify's target probabilities for one
request (`sample/rejection.py target_probs`, `--draft-rows` rows: k drafts + 1), C++ `top_k_top_p_probs`
against the PyTorch filter.

    .venv/bin/python benchmarks/sampling.py [--rows 16] [--vocab 128256] [--repeats 20] [--draft-rows 5]
"""

import argparse
import statistics
import time
from unittest import mock

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402

from sobrio.sample.metadata import SamplingMetadata  # noqa: E402
from sobrio.sample.rejection import target_probs  # noqa: E402
from sobrio.sample.sampler import Sampler  # noqa: E402

CASES = {  # name -> (temperature, top_p, top_k)
    "greedy": (0.0, 1.0, 0),
    "temperature 1": (1.0, 1.0, 0),
    "temperature 0.7, top-p 0.9": (0.7, 0.9, 0),
    "top-p 0.95": (1.0, 0.95, 0),
    "top-k 50": (1.0, 1.0, 50),
}


def metadata(rows: int, temperature: float, top_p: float, top_k: int) -> SamplingMetadata:
    return SamplingMetadata(temperature=[temperature] * rows, top_p=[top_p] * rows, top_k=[top_k] * rows,
                            min_p=[0.0] * rows, generators={}, presence_penalty=[0.0] * rows,
                            frequency_penalty=[0.0] * rows, repetition_penalty=[1.0] * rows,
                            prompt_token_ids=[[]] * rows, output_token_ids=[[]] * rows,
                            banned_token_ids=[[]] * rows, num_logprobs=[None] * rows)


def median_ms(call, logits: torch.Tensor, meta: SamplingMetadata, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(logits, meta)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def table(call, patch: str, rows: dict[str, torch.Tensor], cases: dict, repeats: int) -> None:
    """Each case on each kind of rows, `call` as it is and with the C++ operators hidden at `patch`."""
    print(f"{'rows':8} {'sampling':28} {'C++':>8} {'PyTorch':>9} {'ratio':>7}")
    for kind, logits in rows.items():
        for name, params in cases.items():
            meta = metadata(len(logits), *params)
            fast = median_ms(call, logits, meta, repeats)
            with mock.patch(patch, lambda: None):
                slow = median_ms(call, logits, meta, repeats)
            print(f"{kind:8} {name:28} {fast:8.2f} {slow:9.2f} {slow / fast:6.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=128256, help="Llama 3's (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--draft-rows", type=int, default=5, help="a verify's rows: 4 drafts + 1 by default")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    ranks = torch.stack([torch.randperm(args.vocab, generator=gen) for _ in range(args.rows)]).float() + 1
    rows = {"flat": torch.randn(args.rows, args.vocab, generator=gen) * 3, "peaked": 10 - 1.1 * ranks.log()}
    print(f"Sampler: {args.rows} rows of {args.vocab} logits, median of {args.repeats} calls, ms")
    table(Sampler(), "sobrio.sample.sampler.cpu_ops", rows, CASES, args.repeats)
    verify_rows = {kind: logits[:args.draft_rows] for kind, logits in rows.items()}
    print(f"\nA verify's target probabilities: {args.draft_rows} rows of one request, "
          f"median of {args.repeats} calls, ms")
    table(target_probs, "sobrio.sample.sampler.cpu_ops", verify_rows,
          {name: params for name, params in CASES.items() if params[0] > 0}, args.repeats)

if __name__ == "__main__":
    main()
