"""The router's pieces (gateway/router.py): the trade-off curve, APGR as RouteLLM defines it, training on
separable data, and the weights sobrio ships."""

import numpy as np
import pytest

from sobrio.gateway import router


def _rows(small: list[bool], large: list[bool]) -> list[dict]:
    return [{"small_correct": s, "large_correct": g} for s, g in zip(small, large)]


def test_apgr_of_a_perfect_a_random_and_an_inverted_router():
    rng = np.random.default_rng(0)
    small = rng.random(400) < 0.3
    large = small | (rng.random(400) < 0.5)
    rows = _rows(small.tolist(), large.tolist())
    worth_it = (~small & large).astype(float)
    assert router.apgr(rows, worth_it + 0.01 * rng.random(400)) > 0.8  # the calls worth it come first
    assert abs(router.apgr(rows, rng.random(400)) - 0.5) < 0.1
    assert router.apgr(rows, -worth_it + 0.01 * rng.random(400)) < 0.3
    ends = router.curve(rows, worth_it, [float("inf"), -1.0])
    assert (ends[0].share_large, ends[0].quality) == (0.0, pytest.approx(small.mean()))
    assert (ends[1].share_large, ends[1].quality) == (1.0, pytest.approx(large.mean()))


def test_training_separates_what_is_separable():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 16)).astype(np.float32)
    y = (x[:, 3] > 0.2).astype(np.float32)
    w, b = router.train(x, y)
    weights = router.RouterWeights("s", "l", 0.5, b, w.tolist())
    assert ((weights.scores(x) >= 0.5) == (y > 0)).mean() > 0.95


def test_shipped_weights_and_set_belong_together(tmp_path):
    weights = router.RouterWeights.load()
    assert len(weights.weights) == 384 and weights.embedder == router.EMBEDDER and 0 <= weights.threshold <= 1
    rows = router.read_set()
    assert {r["split"] for r in rows} == {"train", "heldout"} and len(rows) > 300
    assert {(r["small"], r["large"]) for r in rows} == {(weights.small, weights.large)}
    weights.save(tmp_path / "w.json")
    assert router.RouterWeights.load(tmp_path / "w.json") == weights
