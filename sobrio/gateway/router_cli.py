"""`sobrio router train` and `sobrio router eval`: fit the difficulty classifier on the shipped labelled
set's train split, and show on its held-out split what each threshold buys (gateway/router.py)."""

import argparse
import time
from pathlib import Path

THRESHOLDS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]


def add_router_parser(sub) -> None:
    parser = sub.add_parser("router", help="train and evaluate model=\"auto\"'s difficulty classifier")
    actions = parser.add_subparsers(dest="action", required=True)
    train = actions.add_parser("train", help="fit it on sobrio/data/router_set.jsonl's train split")
    train.add_argument("--out", default=None, help="weights file (default: the one sobrio ships, overwritten)")
    train.add_argument("--threshold", type=float, default=0.5, help="the served default (default: 0.5)")
    evaluate = actions.add_parser("eval", help="quality and share of large calls per threshold, APGR, on the "
                                               "held-out split")
    evaluate.add_argument("--weights", default=None, help="weights file (default: the one sobrio ships)")
    evaluate.add_argument("--plot", default=None, help="also draw the curve into this PNG")
    parser.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    return _train(args) if args.action == "train" else _evaluate(args)


def _router():
    """gateway/router.py, imported when a command runs (numpy, torch), not when the CLI is built."""
    from sobrio.gateway import router

    return router


def _train(args: argparse.Namespace) -> int:
    router = _router()
    rows = router.read_set("train")
    embedder = router.open_embedder()
    try:
        x = router.embed_all(embedder, [r["prompt"] for r in rows])
    finally:
        embedder.shutdown()
    y = router.labels(rows)
    w, b = router.train(x, y)
    small, large = rows[0]["small"], rows[0]["large"]
    out = Path(args.out) if args.out else Path(router.__file__).parent.parent / "data" / router.DEFAULT_WEIGHTS
    router.RouterWeights(small, large, args.threshold, b, [round(float(v), 6) for v in w]).save(out)
    print(f"trained on {len(rows)} prompts ({int(y.sum())} worth the large model); weights in {out}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    import numpy as np

    router = _router()
    weights = router.RouterWeights.load(args.weights)
    rows = router.read_set("heldout")
    embedder = router.open_embedder()
    try:
        x = router.embed_all(embedder, [r["prompt"] for r in rows])
        times = _decision_times(embedder, [r["prompt"] for r in rows[:200]])
    finally:
        embedder.shutdown()
    scores = weights.scores(x)
    q_small = np.mean([r["small_correct"] for r in rows])
    q_large = np.mean([r["large_correct"] for r in rows])
    print(f"held-out split: {len(rows)} prompts; small = {weights.small}, large = {weights.large}")
    print(f"always small: quality {q_small:.1%}   always large: quality {q_large:.1%}")
    print("threshold  to large  quality  gap recovered")
    points = router.curve(rows, scores, THRESHOLDS)
    for p in points:
        pgr = (p.quality - q_small) / (q_large - q_small) if q_large > q_small else float("nan")
        print(f"{p.threshold:9.2f}  {p.share_large:8.1%}  {p.quality:7.1%}  {pgr:13.1%}")
    print(f"APGR (area under gap recovered vs share to large): {router.apgr(rows, scores):.3f} (random: 0.5)")
    print(f"decision time per prompt, one at a time: p50 {np.percentile(times, 50) * 1e3:.1f} ms, "
          f"p99 {np.percentile(times, 99) * 1e3:.1f} ms")
    if args.plot:
        _plot(rows, scores, q_small, q_large, Path(args.plot))
    return 0


def _decision_times(embedder, texts: list[str]) -> list[float]:
    """Seconds to embed and score one prompt, as a served request pays them."""
    router, times = _router(), []
    for text in texts:
        start = time.perf_counter()
        router.embed_all(embedder, [text])
        times.append(time.perf_counter() - start)
    return times


def _plot(rows: list[dict], scores, q_small: float, q_large: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    router = _router()
    points = router.curve(rows, scores, [float("inf"), *sorted(set(scores.tolist()), reverse=True)])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p.share_large for p in points], [p.quality for p in points], label="router")
    ax.plot([0, 1], [q_small, q_large], "--", label="random split")
    ax.set_xlabel("share of calls to the large model")
    ax.set_ylabel("quality (held-out, share correct)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"curve drawn in {path}")
