"""The table of `ab_rounds.sh`: each server's figure a round, and each sobrio server's ratio to each peer
within a round, with the median and range over the rounds (the figure to quote on a host whose speed drifts).

    .venv/bin/python benchmarks/peers/rounds_summary.py --seed S --rounds R --servers sobrio vllm
        [--workloads inflight16 ttft4000] [--results results]
"""

import argparse
import json
import statistics
from pathlib import Path

PEERS = ("vllm", "llamacpp")
METRIC = {  # workload -> (result field, unit, higher is better)
    "inflight16": ("output_throughput", "tok/s", True),
    "inflight32": ("output_throughput", "tok/s", True),
    "inflight16-top-p": ("output_throughput", "tok/s", True),
    "ttft1000": ("p50_ttft_ms", "ms TTFT", False),
    "ttft4000": ("p50_ttft_ms", "ms TTFT", False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, required=True, help="the seed ab_rounds.sh ran with")
    parser.add_argument("--rounds", type=int, required=True, help="how many rounds it ran")
    parser.add_argument("--servers", nargs="+", required=True, help="its SERVERS (sobrio, sobrio-int8, vllm, ...)")
    parser.add_argument("--workloads", nargs="+", default=list(METRIC), choices=list(METRIC),
                        help="its WORKLOADS (default: all four)")
    parser.add_argument("--results", type=Path, default=Path("results"),
                        help="the folder of its result files (default: %(default)s)")
    args = parser.parse_args()
    for workload in args.workloads:
        field, unit, higher = METRIC[workload]
        files = {name: [args.results / f"rounds-{name}-{args.seed}-r{r}-{workload}.json" for r in range(args.rounds)]
                 for name in args.servers}
        values = {name: [json.loads(f.read_text())[field] for f in paths] for name, paths in files.items()}
        print(f"{workload} ({unit}), rounds 0-{args.rounds - 1}:")
        for name, v in values.items():
            print(f"  {name:12s} " + " ".join(f"{x:8.1f}" for x in v) + f" | median {statistics.median(v):8.1f}")
        for peer in (p for p in PEERS if p in values):
            for name in (n for n in values if n.startswith("sobrio")):
                # a ratio above 1 is always sobrio ahead: throughput over the peer's, the peer's TTFT over sobrio's
                ratios = [(a / b) if higher else (b / a) for a, b in zip(values[name], values[peer])]
                print(f"  {name} ahead of {peer}: " + " ".join(f"{r:.2f}x" for r in ratios)
                      + f" | median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
