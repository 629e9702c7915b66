"""`sobrio bench serve`: load an OpenAI-compatible server with timed, streamed requests; report SLO metrics."""

import asyncio
import dataclasses
import functools
import json
import time

import aiohttp

from sobrio.bench import datasets
from sobrio.bench.arrivals import arrival_gaps
from sobrio.bench.client import request_body, send
from sobrio.bench.summary import RequestResult, summarize
from sobrio.errors import UnknownModelError


def add_serve_args(parser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokenizer", default=None, help="model alias/folder whose tokenizer builds prompts")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--dataset", default="random", help="random | shared-prefix | multi-turn | PATH.jsonl")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--prefix-len", type=int, default=1000, help="shared-prefix: tokens of each shared prefix")
    parser.add_argument("--num-groups", type=int, default=4, help="shared-prefix: how many prefixes")
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0, help="sent with every request (vLLM's flag)")
    parser.add_argument("--top-p", type=float, default=None, help="sent with every request where given")
    parser.add_argument("--top-k", type=int, default=None, help="sent with every request where given")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", nargs="*", default=[], help="SLOs as ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--percentiles", default="50,90,95,99")
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--save-detailed", action="store_true",
                        help="also write each request's start, prompt and output tokens, TTFT, ITLs and error "
                             "into --result-json (vLLM's flag)")
    parser.add_argument("--plot", default=None, help="PNG path for latency CDFs and tokens/s over time")
    parser.add_argument("--no-progress", action="store_true")


def parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise SystemExit(f"bad --goodput item {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        slos[name] = float(value)
    return slos


def load_dataset(args) -> list[datasets.SampleRequest]:
    tokenizer = _tokenizer(args.tokenizer or args.model)
    n, i, o = args.num_prompts, args.input_len, args.output_len
    if args.dataset == "random":
        return datasets.random_dataset(tokenizer, n, i, o, args.range_ratio, args.seed)
    if args.dataset == "shared-prefix":
        return datasets.shared_prefix_dataset(tokenizer, n, i, o, args.num_groups, args.prefix_len, args.seed)
    if args.dataset == "multi-turn":
        return datasets.multi_turn_dataset(tokenizer, n, i, o, seed=args.seed)
    return datasets.jsonl_dataset(args.dataset, n, o)


@functools.cache
def _tokenizer(name: str):
    """The tokenizer that builds prompts and counts tokens; weights are never loaded for it."""
    try:
        return datasets.load_tokenizer(name)
    except UnknownModelError:  # a remote model name: the default model's tokenizer builds the prompts
        return datasets.load_tokenizer("smollm2-135m")


async def run_requests(args, samples, count_tokens=None) -> tuple[list[RequestResult], float]:
    url = args.base_url.rstrip("/") + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    gaps = arrival_gaps(len(samples), args.request_rate, args.burstiness, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(samples))
    bar = None if args.no_progress else _progress(len(samples))
    connector = aiohttp.TCPConnector(limit=0)  # no cap on connections: max_concurrency is the only limit
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=600.0, sock_read=600.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20) as client:
        t0 = time.perf_counter()

        async def one(sample):
            async with limit:
                body = request_body(sample, args.model, args.endpoint, args.ignore_eos, args.temperature, args.top_p,
                                    args.top_k)
                result = await send(client, url, body, headers, t0, sample, count_tokens)
            bar.update(1) if bar else None
            return result

        tasks = []
        for sample, gap in zip(samples, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(sample)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close() if bar else None
    return list(results), duration


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")


def print_summary(summary: dict, percentiles: list[float]) -> None:
    rows = [("Successful requests", summary["completed"]), ("Failed requests", summary["failed"]),
            ("Benchmark duration (s)", summary["duration"]), ("Total input tokens", summary["total_input_tokens"]),
            ("Total generated tokens", summary["total_output_tokens"]),
            ("Request throughput (req/s)", summary["request_throughput"]),
            ("Output token throughput (tok/s)", summary["output_throughput"]),
            ("Total token throughput (tok/s)", summary["total_token_throughput"])]
    if "request_goodput" in summary:
        rows.append(("Request goodput (req/s)", summary["request_goodput"]))
    for metric in ("ttft", "tpot", "itl", "e2el"):
        rows.append((f"Mean {metric.upper()} (ms)", summary[f"mean_{metric}_ms"]))
        rows.append((f"Median {metric.upper()} (ms)", summary[f"median_{metric}_ms"]))
        rows += [(f"P{p:g} {metric.upper()} (ms)", summary[f"p{p:g}_{metric}_ms"]) for p in percentiles]
    print("=" * 50)
    for name, value in rows:
        print(f"{name:<36}{value:>14.2f}" if isinstance(value, float) else f"{name:<36}{value:>14}")
    if summary["errors"]:
        print("Errors:", ", ".join(summary["errors"]))
    print("=" * 50)


def plot(results: list[RequestResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    done = [r for r in results if r.success]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    series = {"TTFT": [r.ttft for r in done], "TPOT": [r.tpot for r in done if r.tpot is not None],
              "ITL": [g for r in done for g in r.itl]}
    for name, values in series.items():
        if values:
            xs = np.sort(np.asarray(values) * 1000)
            axes[0].plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    axes[0].set(xscale="log", xlabel="latency (ms)", ylabel="fraction of requests / gaps", title="Latency CDFs")
    axes[0].legend()
    times = np.asarray([t for r in done for t in r.chunk_times])
    if times.size:
        bins = np.arange(0, times.max() + 1.0, 1.0)
        counts, edges = np.histogram(times, bins=bins if len(bins) > 1 else 1)
        axes[1].plot(edges[:-1], counts)
    axes[1].set(xlabel="time (s)", ylabel="tokens / s", title="Output tokens per second")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def cmd_bench_serve(args) -> int:
    percentiles = [float(p) for p in args.percentiles.split(",") if p]
    slos = parse_slos(args.goodput)
    samples = load_dataset(args)
    tokenizer = _tokenizer(args.tokenizer or args.model)
    count_tokens = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    results, duration = asyncio.run(run_requests(args, samples, count_tokens))
    summary = summarize(results, duration, percentiles, slos)
    summary.update({"model": args.model, "base_url": args.base_url, "dataset": args.dataset,
                    "num_prompts": len(samples), "request_rate": args.request_rate,
                    "max_concurrency": args.max_concurrency, "burstiness": args.burstiness})
    print_summary(summary, percentiles)
    if args.save_detailed:
        summary["requests"] = [dataclasses.asdict(r) for r in results]
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    if args.plot:
        plot(results, args.plot)
    return 0 if summary["completed"] else 1
