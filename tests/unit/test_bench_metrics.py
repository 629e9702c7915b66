"""Benchmark arithmetic against hand-computed cases; arrival processes; dataset generators."""

import numpy as np
import pytest

from sobrio.bench.arrivals import arrival_gaps
from sobrio.bench.datasets import random_dataset, shared_prefix_dataset
from sobrio.bench.summary import RequestResult, meets_slos, summarize


def _result(ttft, e2e, tokens, itl=(), prompt=10):
    return RequestResult(success=True, prompt_tokens=prompt, output_tokens=tokens, ttft=ttft, e2e=e2e, itl=list(itl))


def test_tpot_and_single_token():
    assert _result(0.1, 0.5, 5).tpot == pytest.approx(0.1)  # (0.5 - 0.1) / 4
    assert _result(0.1, 0.1, 1).tpot is None


def test_summary_percentiles_throughput_goodput():
    results = [_result(0.1, 1.0, 10, [0.1] * 9), _result(0.2, 2.0, 10, [0.2] * 9), _result(0.3, 3.0, 10, [0.3] * 9),
               _result(0.4, 4.0, 10, [0.4] * 9), RequestResult(success=False, error="HTTP 429")]
    s = summarize(results, duration=10.0, percentiles=[50, 99], slos={"ttft": 250})
    assert s["completed"] == 4 and s["failed"] == 1 and s["errors"] == ["HTTP 429"]
    assert s["output_throughput"] == pytest.approx(4.0) and s["request_throughput"] == pytest.approx(0.4)
    assert s["total_token_throughput"] == pytest.approx(8.0)
    assert s["median_ttft_ms"] == pytest.approx(250.0) and s["mean_ttft_ms"] == pytest.approx(250.0)
    assert s["p99_ttft_ms"] == pytest.approx(397.0)  # linear interpolation between 300 and 400
    assert s["mean_tpot_ms"] == pytest.approx(250.0)  # (0.9/9, 1.8/9, 2.7/9, 3.6/9) -> 100..400 ms
    assert s["median_itl_ms"] == pytest.approx(250.0)
    assert s["request_goodput"] == pytest.approx(0.2)  # two of four meet TTFT <= 250 ms


def test_each_slo():
    r = _result(0.2, 1.2, 11)  # tpot 100 ms
    assert meets_slos(r, {"ttft": 200, "tpot": 100, "e2el": 1200})
    assert not meets_slos(r, {"ttft": 199})
    assert not meets_slos(r, {"tpot": 99})
    assert not meets_slos(r, {"e2el": 1199})


def test_poisson_and_gamma_arrivals():
    poisson = arrival_gaps(10_000, rate=5.0, burstiness=1.0, seed=1)
    assert poisson.mean() == pytest.approx(0.2, rel=0.05)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = arrival_gaps(10_000, rate=5.0, burstiness=0.25, seed=1)
    smooth = arrival_gaps(10_000, rate=5.0, burstiness=4.0, seed=1)
    assert bursty.mean() == pytest.approx(0.2, rel=0.1) and smooth.mean() == pytest.approx(0.2, rel=0.05)
    assert bursty.var() > poisson.var() > smooth.var()
    assert not arrival_gaps(5, rate=float("inf")).any()


class _FakeTokenizer:
    all_special_ids = [0, 1, 2]

    def __len__(self):
        return 1000


def test_datasets_exact_lengths_and_shared_prefixes():
    samples = random_dataset(_FakeTokenizer(), 50, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    assert all(len(s.prompt) == s.prompt_len and 50 <= s.prompt_len <= 150 for s in samples)
    assert len({s.prompt[0] for s in samples}) > 10
    shared = shared_prefix_dataset(_FakeTokenizer(), 12, input_len=30, output_len=8, num_groups=3, prefix_len=200)
    assert all(len(s.prompt) == 230 for s in shared)
    groups = {tuple(s.prompt[:200]) for s in shared}
    assert len(groups) == 3
    assert np.mean([s.prompt[:200] == shared[0].prompt[:200] for s in shared]) == pytest.approx(1 / 3)


def test_autotune_search_finds_the_highest_rate_meeting_slos(monkeypatch):
    """With a fake server whose p99 TPOT grows with the rate, the search brackets the capacity."""
    import argparse
    import time

    from sobrio.bench import autotune

    def fake_run(args, samples):
        tpot = 0.010 * args.request_rate  # 10 ms per req/s: the 100 ms SLO breaks above rate 10
        return [RequestResult(success=True, output_tokens=11, ttft=0.05, e2e=0.05 + 10 * tpot)], 1.0

    monkeypatch.setattr(autotune, "run_requests", fake_run)
    monkeypatch.setattr(autotune.asyncio, "run", lambda result: result)
    args = argparse.Namespace(start_rate=1.0, max_rate=64.0, bisect_steps=3, request_rate=None)
    rate, summary = autotune.best_rate(args, [], {"tpot": 100.0}, time.monotonic() + 60)
    assert 8.0 <= rate <= 10.0 and summary["p99_tpot_ms"] <= 100.0
    assert not autotune.p99_meets({"failed": 1, "p99_tpot_ms": 1.0}, {"tpot": 100.0})
