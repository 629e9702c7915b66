"""Model "auto"'s decision time per request (features + score, what the server pays before the answer), one
prompt at a time, idle and under load, against a full all-MiniLM-L6-v2 forward (the router's former embedder)
measured the same way in the same run.

Load: `--load` processes each spinning a single-threaded float32 matmul, as busy engine threads would.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/router_latency.py [--data ../shared/data/router/train.jsonl]
"""

import argparse
import json
import multiprocessing as mp
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


def _times(fn, texts: list[str]) -> np.ndarray:
    out = []
    for text in texts:
        start = time.perf_counter()
        fn(text)
        out.append(time.perf_counter() - start)
    return np.array(out) * 1e3


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
          f"median {np.median([len(t) for t in texts]):.0f} characters")
    print(f"{'':38s}{'router p50':>12s}{'router p99':>12s}{'MiniLM p50':>12s}{'MiniLM p99':>12s}{'p99 ratio':>11s}")
    for label, (ours, theirs) in results.items():
        p50, p99, f50, f99 = (np.percentile(ours, 50), np.percentile(ours, 99), np.percentile(theirs, 50),
                              np.percentile(theirs, 99))
        print(f"{label:38s}{p50:10.3f}ms{p99:10.3f}ms{f50:10.2f}ms{f99:10.2f}ms{f99 / p99:10.1f}x")
    print("target: router p99 <= 5 ms under load:",
          "met" if np.percentile(results[list(results)[-1]][0], 99) <= 5 else "NOT met")


if __name__ == "__main__":
    main()
