"""RouteLLM's router metrics (APGR, CPT(x%), PGR at a share of strong calls), with bootstrap CIs.

As RouteLLM's `evaluate` computes them (routellm/evals/benchmarks.py, evaluate.py, num_results=10): the
11 thresholds are the deciles of the scores (`pd.qcut`'s bin edges: linear interpolation); for the first 10
a prompt goes to the strong model when its score is >= the threshold, for the last (the maximum) when it is
>, so none does. Each threshold gives (share of strong calls, mean correctness); APGR is the trapezoid area
under that curve, less the weak model's accuracy, over the gap between the two models. CPT(x) is the share
of strong calls where the interpolated curve first reaches PGR x. Tied scores stay together (qcut would
raise). The graded format (scores in [0, 1] in place of correct/wrong) goes through the same formulas.
"""

from dataclasses import dataclass

import numpy as np

NUM_RESULTS = 10
METRICS = ("apgr", "cpt50", "cpt80", "pgr30")


def curve(scores: np.ndarray, strong: np.ndarray, weak: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(share of strong calls, mean correctness) at RouteLLM's 11 thresholds, by increasing share."""
    edges = np.quantile(scores, np.linspace(0.0, 1.0, NUM_RESULTS + 1))
    to_strong = scores[None, :] >= edges[:-1, None]
    to_strong = np.vstack([to_strong, scores[None, :] > edges[-1]])
    shares = to_strong.mean(axis=1)
    quality = np.where(to_strong, strong[None, :], weak[None, :]).mean(axis=1)
    order = np.argsort(shares, kind="stable")
    return shares[order], quality[order]


def cpt(shares: np.ndarray, quality: np.ndarray, target: float) -> float:
    """The first share of strong calls at which the linearly interpolated curve reaches `target` quality
    (`np.interp(target, quality, shares)` where the curve increases)."""
    if quality[0] >= target:
        return float(shares[0])
    for i in range(1, len(shares)):
        if quality[i] >= target:
            lo, hi = quality[i - 1], quality[i]
            return float(shares[i - 1] + (target - lo) / (hi - lo) * (shares[i] - shares[i - 1]))
    return float(shares[-1])


def metrics(scores: np.ndarray, strong: np.ndarray, weak: np.ndarray) -> dict[str, float]:
    """APGR, CPT(50%) and CPT(80%) (as shares, 0-1), and PGR at 30% strong calls."""
    r_s, r_w = float(strong.mean()), float(weak.mean())
    if r_s <= r_w:
        return dict.fromkeys(METRICS, float("nan"))
    shares, quality = curve(scores, strong, weak)
    auc = float(np.sum((shares[1:] - shares[:-1]) * (quality[1:] + quality[:-1]) / 2))
    gap = r_s - r_w
    return {"apgr": (auc - r_w) / gap,
            "cpt50": cpt(shares, quality, r_w + 0.5 * gap),
            "cpt80": cpt(shares, quality, r_w + 0.8 * gap),
            "pgr30": (float(np.interp(0.3, shares, quality)) - r_w) / gap}


@dataclass
class Estimate:
    value: float
    low: float
    high: float


def bootstrap(score_fn, strong: np.ndarray, weak: np.ndarray, resamples: int = 1000,
              seed: int = 0) -> dict[str, Estimate]:
    """Each metric and its 95% CI over `resamples` resamples of the prompts (thresholds, r_s and r_w
    recomputed on each). `score_fn(i)` gives the scores for draw i (i = -1: the point estimate); a router's
    are fixed, a random router's differ by draw, so its CI covers the seed too."""
    rng = np.random.default_rng(seed)
    n = len(strong)
    draws = {m: [] for m in METRICS}
    for i in range(resamples):
        pick = rng.integers(0, n, n)
        for m, v in metrics(score_fn(i)[pick], strong[pick], weak[pick]).items():
            draws[m].append(v)
    point = metrics(score_fn(-1), strong, weak)
    return {m: Estimate(point[m], *np.nanpercentile(draws[m], [2.5, 97.5]).tolist()) for m in METRICS}


def random_estimates(strong: np.ndarray, weak: np.ndarray, resamples: int = 1000,
                     seeds: int = 20) -> dict[str, Estimate]:
    """The random router: its value the mean over `seeds` seeds, its CI over resamples and seeds."""
    n = len(strong)
    per_seed = [metrics(np.random.default_rng(s).random(n), strong, weak) for s in range(seeds)]
    result = bootstrap(lambda i: np.random.default_rng(10_000 + max(i, 0)).random(n), strong, weak, resamples)
    for m in METRICS:
        result[m].value = float(np.mean([p[m] for p in per_seed]))
    return result
