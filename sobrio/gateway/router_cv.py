"""Subject-grouped cross-validation of the router: a subject's prompts are all in one fold (never one subject
in training and test), so the figures say how the router does on subjects it never saw, which is what the
held-out check scores. A file without subjects groups by source."""

import numpy as np

from sobrio.gateway import router
from sobrio.gateway.router_data import LabelledSet
from sobrio.gateway.router_metrics import curve, metrics


def group_folds(groups: list[str], folds: int) -> list[np.ndarray]:
    """Fold index per prompt: whole groups, largest first, each into the fold with the fewest prompts."""
    names, counts = np.unique(np.asarray(groups), return_counts=True)
    if len(names) < folds:
        raise ValueError(f"{folds}-fold cross-validation needs at least {folds} subjects, the data has "
                         f"{len(names)}")
    sizes, fold_of = np.zeros(folds, dtype=int), {}
    for i in np.argsort(-counts, kind="stable"):
        fold_of[names[i]] = int(np.argmin(sizes))
        sizes[fold_of[names[i]]] += counts[i]
    index = np.array([fold_of[g] for g in groups])
    return [index == k for k in range(folds)]


def out_of_fold_scores(data: LabelledSet, features: np.ndarray, folds: int) -> np.ndarray:
    """Each prompt's score from the router trained on the other folds."""
    scores = np.zeros(len(data))
    for test in group_folds(data.subjects, folds):
        train = ~test
        weights = router.train(features[train], data.strong[train], data.weak[train],
                               [s for s, t in zip(data.subjects, train) if t], "weak", "strong")
        scores[test] = weights.scores(features[test])
    return scores


def cross_validate(data: LabelledSet, features: np.ndarray, folds: int = 5) -> dict:
    """The out-of-fold metrics over all prompts, with the curve (share of strong calls, PGR) the dashboard reads,
    and per source where there are several (e.g. mmlu, gsm8k)."""
    scores = out_of_fold_scores(data, features, folds)
    result: dict = {"folds": folds, "prompts": len(data)}
    result.update({k: round(v, 4) for k, v in metrics(scores, data.strong, data.weak).items()})
    shares, quality = curve(scores, data.strong, data.weak)
    r_s, r_w = data.strong.mean(), data.weak.mean()
    result["curve"] = [[round(float(c), 4), round(float((a - r_w) / (r_s - r_w)), 4)] for c, a in zip(shares, quality)]
    sources = sorted(set(data.sources))
    if len(sources) > 1:
        for source in sources:
            keep = np.array([s == source for s in data.sources])
            part = metrics(scores[keep], data.strong[keep], data.weak[keep])
            result[source] = {k: round(v, 4) for k, v in part.items()}
    return result
