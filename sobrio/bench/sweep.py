"""`sobrio bench sweep`: `bench serve` over several request rates or concurrencies; one PNG of throughput
against p99 TTFT and p99 TPOT, and the table as JSON."""

import asyncio
import copy
import json

from sobrio.bench.serve import add_serve_args, load_dataset, parse_slos, run_requests
from sobrio.bench.summary import summarize


def add_sweep_args(parser) -> None:
    add_serve_args(parser)
    parser.add_argument("--request-rates", default=None, help="comma-separated, e.g. 1,2,4,inf")
    parser.add_argument("--concurrencies", default=None, help="comma-separated, e.g. 1,8,32")


def sweep_points(args) -> list[tuple[str, float]]:
    if args.concurrencies:
        return [("max_concurrency", int(c)) for c in args.concurrencies.split(",")]
    rates = args.request_rates or "1,2,4,inf"
    return [("request_rate", float(r)) for r in rates.split(",")]


def run_sweep(args) -> list[dict]:
    samples = load_dataset(args)
    percentiles = sorted({99.0, *[float(p) for p in args.percentiles.split(",") if p]})
    rows = []
    for name, value in sweep_points(args):
        point = copy.copy(args)
        setattr(point, name, value)
        results, duration = asyncio.run(run_requests(point, samples))
        summary = summarize(results, duration, percentiles, parse_slos(args.goodput))
        summary[name] = value
        rows.append(summary)
        print(f"{name}={value}: {summary['output_throughput']:.1f} output tok/s, "
              f"p99 TTFT {summary['p99_ttft_ms']:.0f} ms, p99 TPOT {summary['p99_tpot_ms']:.0f} ms, "
              f"failed {summary['failed']}", flush=True)
    return rows


def plot_sweep(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    xs = [r["output_throughput"] for r in rows]
    for ax, key, title in [(axes[0], "p99_ttft_ms", "p99 TTFT"), (axes[1], "p99_tpot_ms", "p99 TPOT")]:
        ax.plot(xs, [r[key] for r in rows], marker="o")
        for r, x in zip(rows, xs):
            label = r.get("request_rate", r.get("max_concurrency"))
            ax.annotate(str(label), (x, r[key]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set(xlabel="output tokens/s", ylabel=f"{title} (ms)", title=f"{title} vs throughput")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def cmd_bench_sweep(args) -> int:
    rows = run_sweep(args)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(rows, f, indent=2, default=str)
    if args.plot:
        plot_sweep(rows, args.plot)
    return 0 if all(r["completed"] for r in rows) else 1
