"""Second round of router ideas under the same subject-grouped 5-fold cross-validation as cv_routers.py
(docs/router.md, "Second round"): answer-option features, gradient-boosted trees, kNN over MiniLM
word-embedding means with the within-subject outcome, separate weak/strong models, rank ensembles. Every
router is ranked against its training folds' scores, as serving ranks a prompt. With --seeds N, the shipped
router, length and the two kNN routers are also cross-validated on N more random subject-to-fold draws,
for the spread of the figures and of their differences with the shipped router.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/router/cv_ideas.py [--data FILE] [--seeds 7] [--quick]
"""

import argparse
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cv_routers import DEFAULT, word_embedding_means  # noqa: E402

from sobrio.gateway import router  # noqa: E402
from sobrio.gateway.router_cv import group_folds  # noqa: E402
from sobrio.gateway.router_data import read_labelled  # noqa: E402
from sobrio.gateway.router_features import LENGTH_COLUMN, PromptFeatures  # noqa: E402
from sobrio.gateway.router_metrics import metrics  # noqa: E402

_OPTION = re.compile(r"^([A-D])\. (.*)$", re.M)
SHIPPED = "shipped: rank(length) + rank(within-subject ridge, form)"
_NUMBER = re.compile(r"^[\s$\-+]*[\d.,/]+\s*[%a-zA-Z]{0,4}\s*$")


def option_features(text: str) -> list[float]:
    """10 numbers about the answer options and the question's type: spread of the options' log lengths,
    longest over mean, numeric share, "of the above", true/false options, "which of the following", a blank,
    stem lines, most/best/likely, options' word overlap with the stem."""
    options = [m.group(2) for m in _OPTION.finditer(text)]
    lengths = np.log1p([len(o) for o in options]) if options else np.zeros(1)
    stem = text.split("\nA. ")[0]
    stem_words = set(stem.lower().split())
    joined = " ".join(options).lower()
    return [lengths.std(), lengths.max() - lengths.mean(),
            float(np.mean([bool(_NUMBER.match(o)) for o in options])) if options else 0.0,
            float("of the above" in text.lower()), float(bool(re.search(r"\b(true|false)\b", joined))),
            float("which of the following" in text.lower()), float("_" in stem), float(stem.count("\n")),
            float(bool(re.search(r"\b(most|best|primarily|likely)\b", stem.lower()))),
            float(np.mean([len(set(o.lower().split()) & stem_words) / max(1, len(o.split())) for o in options]))
            if options else 0.0]


class Bench:
    def __init__(self, path: str):
        self.data = read_labelled(path)
        self.subjects = self.data.subjects
        self.form = PromptFeatures().features(self.data.prompts)
        self.options = np.array([option_features(p) for p in self.data.prompts], dtype=np.float32)
        self.words = word_embedding_means(self.data.prompts)
        self.s, self.w = self.data.strong, self.data.weak
        self.mmlu = np.array([x == "mmlu" for x in self.data.sources])

    def folds(self, seed: int | None) -> list[np.ndarray]:
        """The shipped folds (None), or whole subjects shuffled by `seed` and dealt greedily by size."""
        if seed is None:
            return group_folds(self.subjects, 5)
        names = sorted(set(self.subjects))
        np.random.default_rng(seed).shuffle(names)
        sizes, fold_of = np.zeros(5), {}
        for name in names:
            fold_of[name] = int(np.argmin(sizes))
            sizes[fold_of[name]] += self.subjects.count(name)
        index = np.array([fold_of[g] for g in self.subjects])
        return [index == k for k in range(5)]

    def centred(self, y: np.ndarray, train: np.ndarray) -> np.ndarray:
        groups = np.unique(np.asarray(self.subjects)[train], return_inverse=True)[1]
        return router._centred(y[train].astype(np.float64), groups)

    def evaluate(self, fit, seed: int | None = None) -> tuple[dict, dict]:
        scores = np.zeros(len(self.s))
        for test in self.folds(seed):
            scores[test] = fit(~test, test)[1]
        m, s, w = self.mmlu, self.s, self.w
        return metrics(scores[m], s[m], w[m]), metrics(scores[~m], s[~m], w[~m])


# Each router is fit(train, test) -> (scores of the training prompts, scores of the test prompts).

def constant(values):
    return lambda train, test: (values[train], values[test])


def ridge_within(bench: Bench, x: np.ndarray, y: np.ndarray):
    def fit(train, test):
        mu, sd = x[train].mean(0), np.maximum(x[train].std(0), 1e-6)
        subjects = [g for g, k in zip(bench.subjects, train) if k]
        coef = router.fit_within_subjects((x[train] - mu) / sd, y[train], subjects, router.L2)
        return ((x[train] - mu) / sd) @ coef, ((x[test] - mu) / sd) @ coef
    return fit


def boosted(bench: Bench, x: np.ndarray, y: np.ndarray, within: bool):
    from sklearn.ensemble import HistGradientBoostingRegressor

    def fit(train, test):
        target = bench.centred(y, train) if within else y[train]
        model = HistGradientBoostingRegressor(max_iter=200, learning_rate=0.05, max_leaf_nodes=15,
                                              min_samples_leaf=50, l2_regularization=1.0, random_state=0)
        model.fit(x[train], target)
        return model.predict(x[train]), model.predict(x[test])
    return fit


def neighbours(bench: Bench, x: np.ndarray, y: np.ndarray, k: int, within: bool = True, dims: int = 0):
    """Mean outcome (centred per subject when `within`) of the k nearest training prompts by cosine; with
    `dims`, after a PCA to that many dimensions stored as float16 (what a shipped index would hold)."""
    def fit(train, test):
        target = bench.centred(y, train) if within else y[train]
        project = _pca(x[train], dims) if dims else (lambda a: a)
        index = project(x[train])

        def mean_of_nearest(queries, leave_self_out):
            similarity = queries @ index.T
            if leave_self_out:
                np.fill_diagonal(similarity, -np.inf)
            return target[np.argpartition(-similarity, k, axis=1)[:, :k]].mean(1)
        return mean_of_nearest(index, True), mean_of_nearest(project(x[test]), False)
    return fit


def _pca(x: np.ndarray, dims: int):
    mu = x.mean(0)
    basis = np.linalg.svd(x - mu, full_matrices=False)[2][:dims].T

    def project(a):
        p = (a - mu) @ basis
        return (p / np.maximum(np.linalg.norm(p, axis=1, keepdims=True), 1e-6)).astype(np.float16).astype(np.float32)
    return project


def ranks(parts):
    """Sum of weight x each router's rank among its training prompts' scores (0-1), as serving ranks."""
    def fit(train, test):
        a = b = 0.0
        for weight, part in parts:
            on_train, on_test = part(train, test)
            edges = np.quantile(on_train, np.linspace(0, 1, 101))
            a = a + weight * np.interp(on_train, edges, np.linspace(0, 1, 101))
            b = b + weight * np.interp(on_test, edges, np.linspace(0, 1, 101))
        return a, b
    return fit


def routers(b: Bench, quick: bool) -> dict:
    d, length = b.s - b.w, constant(b.form[:, LENGTH_COLUMN].astype(np.float64))
    both = np.c_[b.form, b.options]
    table = {
        "prompt length": length,
        SHIPPED: ranks([(1, length), (1, ridge_within(b, b.form, d))]),
        "within-subject ridge, form + 10 option/type features": ridge_within(b, both, d),
        "rank(length) + rank(that)": ranks([(1, length), (1, ridge_within(b, both, d))]),
        "rank(length) + rank(ridge, weak wrong) + rank(ridge, strong right)":
            ranks([(1, length), (1, ridge_within(b, b.form, 1 - b.w)), (1, ridge_within(b, b.form, b.s))]),
        "kNN k=50 word-embedding means, raw s - w": neighbours(b, b.words, d, 50, within=False),
        "kNN k=100, within-subject s - w": neighbours(b, b.words, d, 100),
        "kNN k=200, within-subject s - w": neighbours(b, b.words, d, 200),
        "kNN k=400, within-subject s - w": neighbours(b, b.words, d, 400),
        "kNN k=200, PCA 32 float16": neighbours(b, b.words, d, 200, dims=32),
        "rank(length) + rank(kNN k=200)": ranks([(1, length), (1, neighbours(b, b.words, d, 200))]),
        "rank(length) + rank(ridge form) + rank(kNN k=200)":
            ranks([(1, length), (1, ridge_within(b, b.form, d)), (1, neighbours(b, b.words, d, 200))]),
        "rank(length) + rank(ridge form) + rank(kNN k=200, PCA 32)":
            ranks([(1, length), (1, ridge_within(b, b.form, d)), (1, neighbours(b, b.words, d, 200, dims=32))]),
    }
    if not quick:
        table["boosted trees, form, raw s - w"] = boosted(b, b.form, d, within=False)
        table["boosted trees, form + options, within-subject s - w"] = boosted(b, both, d, within=True)
        table["rank(length) + rank(boosted trees, within)"] = ranks([(1, length), (1, boosted(b, both, d, True))])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT), help="labelled JSONL (default: the shared train.jsonl)")
    parser.add_argument("--seeds", type=int, default=0, help="more random subject-to-fold draws for the spread "
                        "(default: 0)")
    parser.add_argument("--subject-bootstrap", type=int, default=0, help="resamples of whole MMLU subjects for "
                        "a CI on the kNN routers' difference with the shipped router (default: 0)")
    parser.add_argument("--quick", action="store_true", help="leave out the boosted trees (minutes each)")
    args = parser.parse_args()
    bench = Bench(args.data)
    table = routers(bench, args.quick)
    print(f"{'router':66s}{'MMLU APGR':>10s}{'CPT50':>8s}{'CPT80':>8s}{'GSM8K APGR':>11s}{'s':>5s}")
    for name, fit in table.items():
        start = time.perf_counter()
        a, g = bench.evaluate(fit)
        print(f"{name:66s}{a['apgr']:10.3f}{a['cpt50']:8.1%}{a['cpt80']:8.1%}{g['apgr']:11.3f}"
              f"{time.perf_counter() - start:5.0f}", flush=True)
    if args.seeds:
        _spread(bench, table, args.seeds)
    if args.subject_bootstrap:
        _subject_bootstrap(bench, table, args.subject_bootstrap)


def _spread(bench: Bench, table: dict, seeds: int) -> None:
    names = ["prompt length", SHIPPED,
             "kNN k=200, within-subject s - w", "rank(length) + rank(ridge form) + rank(kNN k=200)"]
    runs = {n: np.array([_row(bench, table[n], seed) for seed in [None, *range(1, seeds + 1)]]) for n in names}
    print(f"\nover {seeds + 1} subject-to-fold draws: mean (sd) of MMLU APGR, CPT50, CPT80, GSM8K APGR; "
          "then the difference with the shipped router, mean (sd) [min, max]")
    for name, values in runs.items():
        diff = values - runs[names[1]]
        spread = zip(values.mean(0), values.std(0, ddof=1))
        print(f"{name[:50]:50s} " + "  ".join(f"{m:.3f} ({s:.3f})" for m, s in spread))
        print(f"{'  minus shipped':50s} " + "  ".join(f"{m:+.3f} ({s:.3f}) [{lo:+.3f}, {hi:+.3f}]" for m, s, lo, hi in
                                                    zip(diff.mean(0), diff.std(0, ddof=1), diff.min(0), diff.max(0))))


def _subject_bootstrap(bench: Bench, table: dict, resamples: int) -> None:
    """95% intervals of (router - shipped) MMLU APGR and CPT(50%) over resamples of whole MMLU subjects,
    on the shipped folds' out-of-fold scores."""
    names = [SHIPPED, "kNN k=200, within-subject s - w", "rank(length) + rank(ridge form) + rank(kNN k=200)"]
    scores = {}
    for name in names:
        scores[name] = np.zeros(len(bench.s))
        for test in bench.folds(None):
            scores[name][test] = table[name](~test, test)[1]
    subjects = np.asarray(bench.subjects)
    rows = {g: np.flatnonzero(subjects == g) for g in sorted(set(subjects[bench.mmlu]))}
    rng, diffs = np.random.default_rng(0), []
    for _ in range(resamples):
        pick = np.concatenate([rows[g] for g in rng.choice(list(rows), len(rows))])
        m = [metrics(scores[n][pick], bench.s[pick], bench.w[pick]) for n in names]
        diffs.append([m[i][k] - m[0][k] for i in (1, 2) for k in ("apgr", "cpt50")])
    low, mean, high = np.percentile(diffs, 2.5, 0), np.mean(diffs, 0), np.percentile(diffs, 97.5, 0)
    print(f"\n{resamples} resamples of the {len(rows)} MMLU subjects, minus shipped: mean [95% interval]")
    for i, name in enumerate(names[1:]):
        print(f"{name[:50]:50s} APGR {mean[2 * i]:+.3f} [{low[2 * i]:+.3f}, {high[2 * i]:+.3f}]  CPT50 "
              f"{mean[2 * i + 1]:+.3f} [{low[2 * i + 1]:+.3f}, {high[2 * i + 1]:+.3f}]")


def _row(bench: Bench, fit, seed) -> list[float]:
    a, g = bench.evaluate(fit, seed)
    return [a["apgr"], a["cpt50"], a["cpt80"], g["apgr"]]


if __name__ == "__main__":
    main()
