"""The router (gateway/router*.py): RouteLLM's metrics, the README's baselines on the shared labels, the
labelled-file formats, training and calibration, and the train / score / eval commands end to end."""

import json
from pathlib import Path

import numpy as np
import pytest

from sobrio.cli import main
from sobrio.gateway import router
from sobrio.gateway.router_cv import group_folds
from sobrio.gateway.router_data import RouterDataError, read_labelled, read_scores
from sobrio.gateway.router_features import LENGTH_COLUMN, NAMES, PromptFeatures
from sobrio.gateway.router_metrics import bootstrap, curve, metrics, random_estimates

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "router" / "train.jsonl"


def _routellm(scores, strong, weak):
    """RouteLLM's evaluate + generate_results, written out: 10 deciles, >= below the top edge, np.interp."""
    edges = np.quantile(scores, np.linspace(0, 1, 11))
    points = []
    for k, t in enumerate(edges):
        to_strong = scores > t if k == 10 else scores >= t
        points.append((to_strong.mean(), np.where(to_strong, strong, weak).mean()))
    share, acc = np.array(sorted(points)).T
    r_s, r_w = strong.mean(), weak.mean()
    apgr = (np.trapezoid(acc, share) - r_w) / (r_s - r_w)
    return apgr, np.interp(r_w + 0.5 * (r_s - r_w), acc, share), np.interp(r_w + 0.8 * (r_s - r_w), acc, share)


def test_metrics_equal_routellms_path_on_untied_scores_and_order_routers():
    rng = np.random.default_rng(0)
    weak = (rng.random(2000) < 0.6).astype(float)
    strong = np.maximum(weak, rng.random(2000) < 0.5).astype(float)
    oracle = (1 - weak) + 0.01 * rng.random(2000)  # untied, so RouteLLM's curve increases
    got = metrics(oracle, strong, weak)
    assert (got["apgr"], got["cpt50"], got["cpt80"]) == pytest.approx(_routellm(oracle, strong, weak), abs=1e-10)
    assert got["apgr"] > 0.75 and got["cpt50"] < 0.3
    assert abs(metrics(rng.random(2000), strong, weak)["apgr"] - 0.5) < 0.06
    assert metrics(-oracle, strong, weak)["apgr"] < 0.25
    shares, quality = curve(oracle, strong, weak)
    assert (shares[0], shares[-1], quality[0], quality[-1]) == pytest.approx((0, 1, weak.mean(), strong.mean()))
    tied = metrics(np.zeros(2000), strong, weak)  # one score for all: the straight line (qcut would raise)
    assert tied["apgr"] == pytest.approx(0.5) and tied["cpt50"] == pytest.approx(0.5)


# README.md of the shared router data: baselines on train.jsonl, value [95% CI] for APGR, CPT(50%), CPT(80%).
README_FIGURES = {
    ("gsm8k", "random"): ((0.497, 0.440, 0.558), (50.0, 38.7, 59.8), (80.1, 72.7, 86.1)),
    ("gsm8k", "length"): ((0.599, 0.559, 0.642), (36.5, 30.7, 42.5), (66.7, 59.1, 74.2)),
    ("gsm8k", "oracle"): ((0.982, 0.930, 1.044), (13.7, 11.9, 15.3), (21.9, 19.0, 24.5)),
    ("mmlu", "random"): ((0.499, 0.455, 0.545), (50.3, 43.4, 57.6), (79.5, 71.1, 84.3)),
    ("mmlu", "length"): ((0.541, 0.512, 0.573), (43.0, 38.2, 47.8), (77.1, 72.9, 81.0)),
    ("mmlu", "oracle"): ((1.143, 1.095, 1.200), (8.8, 8.1, 9.6), (14.1, 12.9, 15.3)),
}


@pytest.mark.skipif(not SHARED.is_file(), reason=f"the shared router labels are not at {SHARED}")
@pytest.mark.parametrize("source", ["gsm8k", "mmlu"])
def test_baselines_reproduce_the_readme_figures_on_train_jsonl(source):
    data = read_labelled(SHARED)
    part = data.subset(np.array([s == source for s in data.sources]))
    length = np.array([len(p) for p in part.prompts], dtype=float)
    found = {"random": random_estimates(part.strong, part.weak, resamples=100),
             "length": bootstrap(lambda i: length, part.strong, part.weak, resamples=100),
             "oracle": bootstrap(lambda i: 1 - part.weak, part.strong, part.weak, resamples=100)}
    for name, estimates in found.items():
        for metric, scale, (value, low, high) in zip(("apgr", "cpt50", "cpt80"), (1, 100, 100),
                                                     README_FIGURES[source, name]):
            e = estimates[metric]
            assert low <= scale * e.value <= high, (source, name, metric, e)
            if name != "random":  # a fixed router: the README's own point estimate, to its printed digits
                assert scale * e.value == pytest.approx(value, abs=0.0006 * scale), (source, name, metric)
            width = (high - low) / scale  # 100 resamples: the CI's width within a third of the README's
            assert abs((e.high - e.low) - width) < width / 3, (source, name, metric, e)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_labelled_files_booleans_graded_and_clear_errors(tmp_path):
    rows = [{"id": "a", "prompt": "p\u2028q", "strong_correct": True, "weak_correct": False, "subject": "s1"},
            {"id": 7, "prompt": "r", "strong_score": 0.75, "weak_score": 0.25}]
    data = read_labelled(_write(tmp_path / "ok.jsonl", rows))  # a U+2028 inside a prompt is not a line break
    assert data.ids == ["a", "7"] and data.prompts[0] == "p\u2028q" and data.subjects == ["s1", "all"]
    assert data.strong.tolist() == [1.0, 0.75] and data.weak.tolist() == [0.0, 0.25]
    for bad, message in ((dict(rows[0], strong_correct="yes"), "true or false"),
                         (dict(rows[1], weak_score=1.5), r"in \[0, 1\]"),
                         ({"id": "x", "prompt": "p", "strong_correct": True}, "weak_correct"),
                         ({"prompt": "p"}, '"id"')):
        with pytest.raises(RouterDataError, match=message) as exc:
            read_labelled(_write(tmp_path / "bad.jsonl", [rows[0], bad]))
        assert "bad.jsonl:2" in str(exc.value)
    (tmp_path / "scores.jsonl").write_text('{"id": "a", "score": 0.5}\n')
    with pytest.raises(RouterDataError, match="no score for 1 id"):
        read_scores(tmp_path / "scores.jsonl", ["a", "7"])


def test_folds_never_split_a_subject():
    subjects = [f"s{i % 9}" for i in range(500)] + ["big"] * 300
    folds = group_folds(subjects, 5)
    assert sum(f.sum() for f in folds) == 800
    for fold in folds:
        inside = {s for s, f in zip(subjects, fold) if f}
        assert inside and not inside & {s for s, f in zip(subjects, fold) if not f}
    with pytest.raises(ValueError, match="at least 5 subjects"):
        group_folds(["a", "b"], 5)


def test_training_learns_within_subjects_and_calibrates_the_strong_share():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(600, len(NAMES))).astype(np.float32)
    subjects = [f"s{i % 4}" for i in range(600)]
    shift = np.array([{"s0": 2.0, "s1": -2.0}.get(s, 0.0) for s in subjects])
    x[:, 3] += shift  # a subject-wide offset of feature 3 says nothing about a question: centred away
    weak = (x[:, 2] < 0.3).astype(float)  # the weak model fails where feature 2 is high
    strong = np.ones(600)
    learned = router.train(x, strong, weak, subjects, "small", "large", mix=100.0)  # the model's rank, nearly
    assert metrics(learned.scores(x), strong, weak)["apgr"] > 0.75
    assert np.argmax(np.abs(learned.weights)) == 2 and abs(learned.weights[3]) < 0.05
    x[:, LENGTH_COLUMN] = x[:, 2] + rng.normal(size=600)  # length is a noisy sign of it: the mix adds to it
    weights = router.train(x, strong, weak, subjects, "small", "large", strong_share=0.3)
    assert metrics(weights.scores(x), strong, weak)["apgr"] > metrics(x[:, LENGTH_COLUMN], strong, weak)["apgr"]
    for share in (0.1, 0.3, 0.8):
        sent = (weights.scores(x) >= weights.threshold_for_share(share)).mean()
        assert sent == pytest.approx(share, abs=0.01)
    assert (weights.scores(x) >= weights.threshold).mean() == pytest.approx(0.3, abs=0.01)
    assert weights.threshold_for_share(0.0) == float("inf")


def test_shipped_weights_load_and_score_prompts():
    weights = router.RouterWeights.load()
    assert len(weights.weights) == len(weights.mean) == len(weights.scale) == len(NAMES)
    assert weights.quality["mmlu"]["apgr"] > 0.55 and len(weights.quality["curve"]) == 11
    r = router.Router(weights)
    for text in ("What is 2 + 2?", "", "x" * 20_000):
        model, score = r.choose(text)
        assert model in (weights.small, weights.large) and 0 <= score <= 1


def test_train_score_eval_commands_end_to_end(tmp_path, capsys):
    """A file where the strong model is right on long prompts about chemistry and the weak one is not."""
    rng = np.random.default_rng(2)
    rows = []
    for i in range(120):
        hard = i % 2 == 0
        words = rng.choice(["molar", "enthalpy", "titration", "orbital"] if hard else ["cat", "sun", "tree"], 12)
        rows.append({"id": f"q{i}", "prompt": " ".join(words), "subject": f"s{i % 5}", "source": "toy",
                     "strong_correct": True, "weak_correct": bool(not hard or rng.random() < 0.2)})
    data = _write(tmp_path / "train.jsonl", rows)
    weights, scores = tmp_path / "w.json", tmp_path / "scores.jsonl"
    assert main(["router", "train", "--data", str(data), "--out", str(weights), "--strong-share", "0.4",
                 "--folds", "3"]) == 0
    assert router.RouterWeights.load(weights).quality["apgr"] > 0.65  # cross-validated across subjects
    assert main(["router", "score", "--data", str(data), "--out", str(scores), "--weights", str(weights)]) == 0
    lines = [json.loads(line) for line in scores.read_text().splitlines()]
    assert [x["id"] for x in lines] == [r["id"] for r in rows]
    hard = np.mean([x["score"] for x, r in zip(lines, rows) if not r["weak_correct"]])
    assert hard > np.mean([x["score"] for x, r in zip(lines, rows) if r["weak_correct"]])
    capsys.readouterr()
    assert main(["router", "eval", "--data", str(data), "--scores", str(scores), "--resamples", "50",
                 "--plot", str(tmp_path / "curve.png")]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("router", "random", "prompt length", "oracle", "APGR", "CPT(50%)"))
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["router", "eval", "--data", str(tmp_path / "missing.jsonl")]) == 2


def test_form_features_of_a_multiple_choice_question():
    text = "Which of these is NOT a noble gas?\nA. Neon\nB. Argon\nC. Nitrogen\nD. Xenon\nAnswer:"
    row = dict(zip(NAMES, PromptFeatures().features([text])[0]))
    assert row["log chars"] == pytest.approx(np.log1p(len(text)))
    assert row["log stem chars"] == pytest.approx(np.log1p(len("Which of these is NOT a noble gas?")))
    assert row["log mean option chars"] == pytest.approx(np.log1p(np.mean([4, 5, 8, 5])))
    assert (row["multiple choice"], row["NOT/EXCEPT/LEAST"], row["has a year"], row["digit share"]) == (1, 1, 0, 0)
    assert 0 < row["continuation-piece share"] < 0.5


def test_the_served_threshold_from_the_flags_or_the_router_table():
    from types import SimpleNamespace

    from sobrio.gateway.config import GatewayConfig, RouterSpec
    from sobrio.gateway.gateway import start_router

    weights = router.RouterWeights.load()
    served = ["weak-m", "strong-m"]
    table = GatewayConfig(router=RouterSpec(small="weak-m", large="strong-m", strong_share=0.2))

    def started(threshold=None, share=None, gateway=table):
        flags = SimpleNamespace(router_weights=None, router_threshold=threshold, router_strong_share=share)
        return start_router(flags, gateway, served)

    assert started(threshold=0.9).threshold == 0.9
    assert started(share=0.3).threshold == weights.threshold_for_share(0.3)
    chosen = started()
    assert chosen.threshold == weights.threshold_for_share(0.2) and chosen.weights.large == "strong-m"
    assert started(gateway=GatewayConfig(router=RouterSpec(small="weak-m", large="strong-m"))).threshold == \
        weights.threshold
    assert started(gateway=GatewayConfig()) is None  # the weights' own two models are not served
    assert weights.threshold == pytest.approx(weights.threshold_for_share(0.5))  # the shipped default: half
