"""Model "auto"'s decision time per request (features + score, what the server pays before the answer), one
prompt at a time, idle and under load, against a full all-MiniLM-L6-v2 forward (the router's former embedder)
measured the same way in the same run.

Load: `--load` processes each spinning a single-threaded float32 matmul, as busy engine threads would.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/router_latency.py [--data ../shared/data/router/train.jsonl]
"""

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "router" / "train.jsonl"


def _spin(stop) -> None:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def _times(fn, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Milliseconds per call: wall clock (what a request waits, the OS's scheduling included) and this
    thread's CPU time (the work itself)."""
    wall, cpu = [], []
    for text in texts:
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn(text)
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return np.array(wall) * 1e3, np.array(cpu) * 1e3


def _prompts(path: Path, count: int) -> list[str]:
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().split("\n") if line.strip()]
    else:  # the shipped self-made set, where the shared labels are not beside the clone
        from importlib import resources

        text = resources.files("sobrio.data").joinpath("router_set.jsonl").read_text()
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    rng = np.random.default_rng(0)
    return [rows[i]["prompt"] for i in rng.permutation(len(rows))[:count]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="JSONL with a prompt per line")
    parser.add_argument("--prompts", type=int, default=2000, help="prompts timed for the router (default: 2000)")
    parser.add_argument("--minilm-prompts", type=int, default=200, help="prompts timed for the full MiniLM "
                        "forward (default: 200)")
    parser.add_argument("--load", type=int, default=2, help="busy processes during the loaded run (default: 2)")
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from sobrio.gateway.router import Router, RouterWeights
    from sobrio.loader.resolve import resolve_model

    torch.set_num_threads(1)  # the server's event loop thread
    texts = _prompts(Path(args.data), args.prompts)
    router = Router(RouterWeights.load())
    minilm = SentenceTransformer(str(resolve_model("all-minilm-l6-v2").path), device="cpu")
    full = lambda text: minilm.encode([text], normalize_embeddings=True)
    full(texts[0])
    results = {}
    for label, load in (("idle", 0), (f"under load ({args.load} busy processes)", args.load)):
        stop = mp.Event()
        spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(load)]
        for p in spinners:
            p.start()
        try:
            time.sleep(1.0 if load else 0.0)
            results[label] = (_times(router.choose, texts), _times(full, texts[:args.minilm_prompts]))
        finally:
            stop.set()
            for p in spinners:
                p.join(10)
    print(f"{len(texts)} prompts (router), {args.minilm_prompts} (full MiniLM), one at a time; "
          f"median {np.median([len(t) for t in texts]):.0f} characters; load average now "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'':34s}{'router p50':>11s}{'p99':>9s}{'p99 CPU':>9s}{'MiniLM p50':>12s}{'p99':>9s}{'p99 CPU':>9s}"
          f"{'p99 ratio':>10s}")
    for label, ((ours, ours_cpu), (theirs, theirs_cpu)) in results.items():
        p = lambda x, q: np.percentile(x, q)
        print(f"{label:34s}{p(ours, 50):9.3f}ms{p(ours, 99):7.2f}ms{p(ours_cpu, 99):7.2f}ms{p(theirs, 50):10.1f}ms"
              f"{p(theirs, 99):7.1f}ms{p(theirs_cpu, 99):7.1f}ms{p(theirs, 99) / p(ours, 99):9.1f}x")
    worst = results[list(results)[-1]][0]
    print(f"target: router p99 <= 5 ms under load: {'met' if np.percentile(worst[0], 99) <= 5 else 'NOT met'} "
          f"(wall), {'met' if np.percentile(worst[1], 99) <= 5 else 'NOT met'} (CPU time)")

if __name__ == "__main__":
    main()
