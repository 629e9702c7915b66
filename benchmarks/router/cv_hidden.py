"""Third round of router ideas (docs/router.md, "Third round"): the served weak model's own hidden states
(SmolLM2-135M, cached by smollm_states.py) under the same subject-grouped 5-fold cross-validation as
cv_ideas.py, alone, beside the form features, MiniLM word embeddings and option features, as a within-subject
ridge, kNN, a small MLP and a pairwise ranking loss. Each row: MMLU APGR and CPT(50%) with bootstrap 95% CIs
over the prompts; then, for the routers named in CONTENDERS, the spread over more subject-to-fold draws and a
bootstrap over whole MMLU subjects of their difference with the shipped router.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/router/cv_hidden.py --states /tmp/smollm.npz [--seeds 4]
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cv_ideas import SHIPPED, Bench, constant, neighbours, ranks, ridge_within  # noqa: E402
from cv_routers import DEFAULT  # noqa: E402

from sobrio.gateway import router  # noqa: E402
from sobrio.gateway.router_features import LENGTH_COLUMN  # noqa: E402
from sobrio.gateway.router_metrics import bootstrap, metrics  # noqa: E402

KNN_HIDDEN = "kNN k=200, hidden mean, within-subject"
ALL3 = "rank(length) + rank(ridge form) + rank(kNN hidden)"
ALL4 = "rank(length) + rank(ridge form) + rank(kNN hidden) + rank(kNN words)"
PAIRWISE = "pairwise logistic within subjects, form + options + hidden PCA 32"
PAIRWISE_FORM = "pairwise logistic within subjects, form + options"
PAIRWISE_3 = "rank(length) + rank(ridge form) + rank(pairwise form + options)"
CONTENDERS = (ALL3, ALL4, PAIRWISE, PAIRWISE_FORM, PAIRWISE_3)


def cached(fit):
    """The same fit, computed once per training fold (rank ensembles reuse their parts' fits)."""
    memo = {}

    def once(train, test):
        key = (train.tobytes(), test.tobytes())
        if key not in memo:
            memo[key] = fit(train, test)
        return memo[key]
    return once


def unit(x: np.ndarray) -> np.ndarray:
    x = x - x.mean(0)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-6)


def ridge(bench: Bench, x: np.ndarray, y: np.ndarray, l2: float):
    """Within-subject ridge (router.fit_within_subjects) with its own penalty."""
    def fit(train, test):
        mu, sd = x[train].mean(0), np.maximum(x[train].std(0), 1e-6)
        subjects = [g for g, k in zip(bench.subjects, train) if k]
        coef = router.fit_within_subjects((x[train] - mu) / sd, y[train], subjects, l2)
        return ((x[train] - mu) / sd) @ coef, ((x[test] - mu) / sd) @ coef
    return fit


def logistic_raw(x: np.ndarray, y: np.ndarray, l2: float):
    """Logistic regression on the raw soft target (s - w + 1) / 2, subject base rates included."""
    from cv_routers import logistic

    def fit(train, test):
        mu, sd = x[train].mean(0), np.maximum(x[train].std(0), 1e-6)
        coef = logistic((x[train] - mu) / sd, (y[train] + 1) / 2, l2)
        return ((x[train] - mu) / sd) @ coef[:-1], ((x[test] - mu) / sd) @ coef[:-1]
    return fit


def reduced(x: np.ndarray, dims: int, fit_rows: np.ndarray) -> np.ndarray:
    """x projected on the first `dims` principal components of `fit_rows` (the training fold)."""
    mu = x[fit_rows].mean(0)
    basis = np.linalg.svd(x[fit_rows] - mu, full_matrices=False)[2][:dims].T
    return (x - mu) @ basis


def mlp(bench: Bench, x: np.ndarray, y: np.ndarray, hidden_dims: int):
    """A one-hidden-layer MLP (sklearn) on the within-subject outcome, the hidden states reduced to 32
    principal components of the training fold beside the other columns `x`."""
    from sklearn.neural_network import MLPRegressor

    def fit(train, test):
        z = np.c_[x, reduced(bench.hidden, 32, train)]
        mu, sd = z[train].mean(0), np.maximum(z[train].std(0), 1e-6)
        z = (z - mu) / sd
        model = MLPRegressor(hidden_layer_sizes=(hidden_dims,), alpha=1.0, early_stopping=True, max_iter=300,
                             random_state=0)
        model.fit(z[train], bench.centred(y, train))
        return model.predict(z[train]), model.predict(z[test])
    return fit


def pairwise(bench: Bench, x: np.ndarray, y: np.ndarray, components: int = 32, pairs: int = 40_000,
             l2: float = 1e-3):
    """A linear score trained on pairs of prompts of one subject whose outcomes differ (logistic loss on the
    difference of their features: RankNet, linear), with the hidden states reduced to `components`."""
    import torch

    def fit(train, test):
        z = np.c_[x, reduced(bench.hidden, components, train)] if components else x
        mu, sd = z[train].mean(0), np.maximum(z[train].std(0), 1e-6)
        z = (z - mu) / sd
        rng, subjects = np.random.default_rng(0), np.asarray(bench.subjects)
        rows = np.flatnonzero(train)
        i, j = rng.choice(rows, pairs), rng.choice(rows, pairs)
        keep = (subjects[i] == subjects[j]) & (y[i] != y[j])
        for _ in range(20):  # more draws until enough same-subject pairs
            if keep.sum() >= pairs // 4:
                break
            a, b = rng.choice(rows, pairs), rng.choice(rows, pairs)
            i, j = np.r_[i, a], np.r_[j, b]
            keep = (subjects[i] == subjects[j]) & (y[i] != y[j])
        i, j = i[keep], j[keep]
        d = torch.from_numpy((z[i] - z[j]).astype(np.float32))
        t = torch.from_numpy((y[i] > y[j]).astype(np.float32))
        w = torch.zeros(z.shape[1], requires_grad=True)
        opt = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")

        def loss_fn():
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(d @ w, t) + l2 * w.square().sum()
            loss.backward()
            return loss
        opt.step(loss_fn)
        coef = w.detach().numpy()
        return z[train] @ coef, z[test] @ coef
    return fit


def routers(b: Bench, states: dict) -> dict:
    d, length = b.s - b.w, constant(b.form[:, LENGTH_COLUMN].astype(np.float64))
    mean_key = max((k for k in states if k.startswith("mean")), key=lambda k: int(k[4:]))
    mid_key = min((k for k in states if k.startswith("mean")), key=lambda k: int(k[4:]))
    last_key = next(k for k in states if k.startswith("last"))
    hidden, mid, last = states[mean_key], states[mid_key], states[last_key]
    b.hidden = hidden
    h_unit = unit(hidden)
    form_options = np.c_[b.form, b.options]
    form_ridge = cached(ridge_within(b, b.form, d))
    hidden_ridge = cached(ridge(b, hidden, d, 1.0))
    knn_hidden = cached(neighbours(b, h_unit, d, 200))
    knn_words = cached(neighbours(b, b.words, d, 200))
    everything = cached(ridge(b, np.c_[b.words, hidden, form_options], d, 1.0))
    small_mlp = cached(mlp(b, form_options, d, 32))
    ranking = cached(pairwise(b, form_options, d))
    ranking_form = cached(pairwise(b, form_options, d, components=0))
    return {
        "prompt length": length,
        SHIPPED: ranks([(1, length), (1, form_ridge)]),
        f"logistic, raw outcome, hidden {mean_key} + form": logistic_raw(np.c_[hidden, b.form], d, 1e-2),
        f"within-subject ridge, hidden {mean_key}": hidden_ridge,
        f"within-subject ridge, hidden {mid_key}": ridge(b, mid, d, 1.0),
        f"within-subject ridge, hidden {last_key}": ridge(b, last, d, 1.0),
        f"within-subject ridge, hidden {mean_key} + form": ridge(b, np.c_[hidden, b.form], d, 1.0),
        "rank(length) + rank(ridge form) + rank(ridge hidden)":
            ranks([(1, length), (1, form_ridge), (1, hidden_ridge)]),
        KNN_HIDDEN: knn_hidden,
        "kNN k=200, word-embedding means (round 2)": knn_words,
        ALL3: ranks([(1, length), (1, form_ridge), (1, knn_hidden)]),
        ALL4: ranks([(1, length), (1, form_ridge), (1, knn_hidden), (1, knn_words)]),
        "within-subject ridge, words + hidden + form + options": everything,
        "rank(length) + rank(that)": ranks([(1, length), (1, everything)]),
        "MLP (32 units), form + options + hidden PCA 32, within-subject": small_mlp,
        "rank(length) + rank(that) ": ranks([(1, length), (1, small_mlp)]),
        PAIRWISE: ranking,
        "rank(length) + rank(that)  ": ranks([(1, length), (1, ranking)]),
        PAIRWISE_FORM: ranking_form,
        PAIRWISE_3: ranks([(1, length), (1, form_ridge), (1, ranking_form)]),
    }


def out_of_fold(bench: Bench, fit, seed=None) -> np.ndarray:
    scores = np.zeros(len(bench.s))
    for test in bench.folds(seed):
        scores[test] = fit(~test, test)[1]
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT), help="labelled JSONL (default: the shared train.jsonl)")
    parser.add_argument("--states", required=True, help="smollm_states.py's .npz for the same file")
    parser.add_argument("--resamples", type=int, default=300, help="bootstrap resamples of the prompts "
                        "(default: 300)")
    parser.add_argument("--seeds", type=int, default=4, help="more subject-to-fold draws for the contenders "
                        "(default: 4)")
    parser.add_argument("--subject-bootstrap", type=int, default=300, help="resamples of whole MMLU subjects "
                        "for the contenders' difference with the shipped router (default: 300)")
    args = parser.parse_args()
    bench = Bench(args.data)
    states = dict(np.load(args.states))
    table = routers(bench, states)
    m, s, w = bench.mmlu, bench.s, bench.w
    print(f"{'router':68s}{'MMLU APGR [95% CI]':>24s}{'CPT50 [95% CI]':>22s}{'CPT80':>7s}{'GSM8K':>7s}{'s':>5s}")
    scores = {}
    for name, fit in table.items():
        start = time.perf_counter()
        scores[name] = x = out_of_fold(bench, fit)
        e = bootstrap(lambda i, mine=x[m]: mine, s[m], w[m], args.resamples)
        g = metrics(x[~m], s[~m], w[~m])
        print(f"{name:68s}{e['apgr'].value:8.3f} [{e['apgr'].low:.3f}, {e['apgr'].high:.3f}]"
              f"{e['cpt50'].value:8.1%} [{e['cpt50'].low:.1%}, {e['cpt50'].high:.1%}]{e['cpt80'].value:7.1%}"
              f"{g['apgr']:7.3f}{time.perf_counter() - start:5.0f}", flush=True)
    _noise(bench, table, scores, args.seeds, args.subject_bootstrap)


def _noise(bench: Bench, table: dict, scores: dict, seeds: int, resamples: int) -> None:
    """Per contender minus shipped: over fold draws (mean, sd, min, max), and over resampled MMLU subjects."""
    m, s, w = bench.mmlu, bench.s, bench.w
    subjects = np.asarray(bench.subjects)
    rows = {g: np.flatnonzero(subjects == g) for g in sorted(set(subjects[m]))}
    rng = np.random.default_rng(0)
    picks = [np.concatenate([rows[g] for g in rng.choice(list(rows), len(rows))]) for _ in range(resamples)]
    base = {seed: out_of_fold(bench, table[SHIPPED], seed) for seed in range(1, seeds + 1)}
    print(f"\nminus shipped: over {seeds + 1} fold draws mean (sd) [min, max]; over {resamples} resamples of the "
          f"{len(rows)} MMLU subjects mean [95% interval]")
    for name in CONTENDERS:
        draws = []
        for seed in [None, *range(1, seeds + 1)]:
            mine = scores[name] if seed is None else out_of_fold(bench, table[name], seed)
            ref = scores[SHIPPED] if seed is None else base[seed]
            a, r = metrics(mine[m], s[m], w[m]), metrics(ref[m], s[m], w[m])
            draws.append([a["apgr"] - r["apgr"], a["cpt50"] - r["cpt50"]])
        draws = np.array(draws)
        boot = []
        for pick in picks:
            a, r = metrics(scores[name][pick], s[pick], w[pick]), metrics(scores[SHIPPED][pick], s[pick], w[pick])
            boot.append([a["apgr"] - r["apgr"], a["cpt50"] - r["cpt50"]])
        lo, mid, hi = np.percentile(boot, 2.5, 0), np.mean(boot, 0), np.percentile(boot, 97.5, 0)
        print(f"{name[:68]:68s}")
        for k, label in enumerate(("APGR", "CPT50")):
            print(f"    {label:6s} folds {draws[:, k].mean():+.3f} ({draws[:, k].std(ddof=1):.3f}) "
                  f"[{draws[:, k].min():+.3f}, {draws[:, k].max():+.3f}]   subjects {mid[k]:+.3f} "
                  f"[{lo[k]:+.3f}, {hi[k]:+.3f}]", flush=True)


if __name__ == "__main__":
    main()
