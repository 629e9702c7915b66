"""`sobrio router eval`'s table and plot: the router beside RouteLLM's random router, prompt length and the
oracle (1 where the weak model is wrong), each metric with its bootstrap 95% CI."""

from pathlib import Path

import numpy as np

from sobrio.gateway.router_data import LabelledSet
from sobrio.gateway.router_metrics import bootstrap, curve, random_estimates

_HEAD = f"{'':14s}{'APGR':>22s}{'CPT(50%)':>24s}{'CPT(80%)':>24s}{'PGR@30%':>22s}"


def baselines(data: LabelledSet) -> dict[str, np.ndarray]:
    return {"prompt length": np.array([len(p) for p in data.prompts], dtype=float), "oracle": 1.0 - data.weak}


def _cell(e, percent: bool) -> str:
    if percent:
        return f"{100 * e.value:5.1f}% [{100 * e.low:5.1f}, {100 * e.high:5.1f}]"
    return f"{e.value:6.3f} [{e.low:6.3f}, {e.high:6.3f}]"


def print_block(name: str, data: LabelledSet, scores: np.ndarray, resamples: int) -> None:
    """One part's table: its accuracies, then a line per router."""
    r_s, r_w = data.strong.mean(), data.weak.mean()
    print(f"\n{name}: {len(data)} prompts; strong {r_s:.2%}, weak {r_w:.2%}, gap {100 * (r_s - r_w):.2f} points")
    if r_s <= r_w:
        print("  the strong model is not better here: nothing to route")
        return
    rows = [("router", bootstrap(lambda i: scores, data.strong, data.weak, resamples)),
            ("random", random_estimates(data.strong, data.weak, resamples))]
    rows += [(label, bootstrap(lambda i, s=s: s, data.strong, data.weak, resamples))
             for label, s in baselines(data).items()]
    print(_HEAD)
    for label, est in rows:
        print(f"{label:14s}{_cell(est['apgr'], False):>22s}{_cell(est['cpt50'], True):>24s}"
              f"{_cell(est['cpt80'], True):>24s}{_cell(est['pgr30'], False):>22s}")


def plot_curves(data: LabelledSet, scores: np.ndarray, path: Path) -> None:
    """Quality against the share of strong calls, RouteLLM's 11 points per router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, s in [("router", scores), *baselines(data).items()]:
        shares, quality = curve(s, data.strong, data.weak)
        ax.plot(shares, quality, marker=".", label=label)
    ax.plot([0, 1], [data.weak.mean(), data.strong.mean()], "--", color="grey", label="random")
    ax.set_xlabel("share of calls to the strong model")
    ax.set_ylabel("mean correctness")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"curves drawn in {path}")
