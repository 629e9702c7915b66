"""Draft verification (`sample.rejection`): greedy keeps exactly the drafts greedy decoding would produce;
rejection sampling against point-mass drafts leaves every position distributed as the target's row."""

import pytest
import torch
from scipy.stats import chisquare

from sobrio.layers.cpu_ops import cpu_ops
from sobrio.sample.metadata import SamplingMetadata
from sobrio.sample.rejection import accept_greedy, accept_random, target_probs, verify
from sobrio.speculative.ngram import NgramProposer


def meta(rows: int, temperature: float, top_k: int = 0, logprobs: int | None = None, seed: int | None = None):
    generators = {} if seed is None else dict.fromkeys(range(rows), torch.Generator().manual_seed(seed))
    return SamplingMetadata(temperature=[temperature] * rows, top_p=[1.0] * rows, top_k=[top_k] * rows,
                            min_p=[0.0] * rows, generators=generators,
                            presence_penalty=[0.0] * rows, frequency_penalty=[0.0] * rows,
                            repetition_penalty=[1.0] * rows, prompt_token_ids=[[]] * rows,
                            output_token_ids=[[]] * rows, banned_token_ids=[[]] * rows, num_logprobs=[logprobs] * rows)


@pytest.mark.parametrize("drafts, expected", [([3, 1, 2], [3, 1, 2, 0]), ([3, 2, 2], [3, 1]), ([0, 1, 2], [3]),
                                              ([3], [3, 1])])
def test_greedy_keeps_the_drafts_up_to_the_first_that_is_not_the_argmax(drafts, expected):
    argmax = [3, 1, 2, 0]
    logits = torch.full((len(drafts) + 1, 5), -1.0)
    logits[torch.arange(len(drafts) + 1), torch.tensor(argmax[:len(drafts) + 1])] = 2.0
    assert accept_greedy(logits, drafts) == expected
    assert [t.token_id for t in verify(logits, meta(len(drafts) + 1, 0.0), drafts)] == expected


def test_verify_returns_each_tokens_logprob_from_its_own_row():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    target = logits.argmax(-1).tolist()
    tokens = verify(logits, meta(3, 0.0, logprobs=2), target[:2])
    assert [t.token_id for t in tokens] == target
    for row, token in enumerate(tokens):
        row_lp = logits[row].log_softmax(-1)
        assert token.logprob == pytest.approx(row_lp[token.token_id].item()) and token.rank == 1
        assert [i for i, _ in token.top_logprobs] == row_lp.topk(2).indices.tolist()


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = probs.double() / probs.double().sum() * n
    big = expected >= 5
    f_obs = [*counts[big].tolist(), counts[~big].sum().item()]
    f_exp = [*expected[big].tolist(), expected[~big].sum().item()]
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    return chisquare(f_obs, f_exp).pvalue


def test_rejection_sampling_gives_the_targets_distribution_at_every_position():
    """Three rows of a 6-token target, drafts 2 then 4: the first output is distributed as row 0; the
    second, after an accepted draft 2, as row 1; the third, after 2 and 4 accepted, as row 2."""
    probs = torch.tensor([[0.05, 0.1, 0.4, 0.2, 0.15, 0.1],
                          [0.3, 0.05, 0.05, 0.1, 0.35, 0.15],
                          [0.1, 0.2, 0.3, 0.1, 0.2, 0.1]])
    drafts, draws, generator = [2, 4], 20000, torch.Generator().manual_seed(7)
    samples = [accept_random(probs, drafts, generator) for _ in range(draws)]
    for position in range(3):
        after_drafts = [s[position] for s in samples if len(s) > position and s[:position] == drafts[:position]]
        counts = torch.bincount(torch.tensor(after_drafts), minlength=6)
        assert _chi_square_pvalue(counts, probs[position]) > 0.001, position
    accepted = sum(len(s) - 1 for s in samples) / draws
    assert accepted == pytest.approx(0.4 + 0.4 * 0.35, abs=0.02)  # p0(2) + p0(2) p1(4)


def test_a_token_outside_top_k_is_never_kept():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]] * 2)
    for seed in range(200):
        tokens = [t.token_id for t in verify(logits, meta(2, 1.0, top_k=2, seed=seed), [0])]
        assert tokens[0] in (2, 3) and len(tokens) == 1  # draft 0 is outside the top 2: always rejected


@pytest.mark.parametrize("tokens, expected", [
    ([1, 2, 3, 4, 9, 1, 2, 3], [4, 9, 1]),  # the 3-gram 1 2 3 recurs: what followed it
    ([5, 6, 7, 8], []),  # nothing recurs
    ([1, 2, 8, 1, 2, 9, 1, 2], [9, 1, 2]),  # the latest match wins
])
def test_ngram_proposes_what_followed_the_latest_earlier_match(tokens, expected):
    assert NgramProposer(2, 4, 3).propose(tokens, limit=3) == expected
    assert NgramProposer(2, 4, 3).propose(tokens, limit=1) == expected[:1]


def test_spec_decode_metrics_take_vllms_names_only_for_a_model_that_speculates():
    from sobrio.engine.client import EngineStats
    from sobrio.server.prometheus import spec_decode_families

    stats = {"num_drafts": 3, "num_draft_tokens": 12, "num_accepted_tokens": 7, "accepted_per_position": [3, 2, 1, 1]}
    families = {f.name: f for f in spec_decode_families("vllm", [("a", EngineStats.from_dict({"spec_decode": stats})),
                                                                 ("b", EngineStats())])}
    assert set(families) == {"vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                             "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos"}
    assert [s.value for s in families["vllm:spec_decode_num_accepted_tokens"].samples
            if s.name.endswith("_total")] == [7]
    per_position = {s.labels["position"]: s.value for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"]
                    .samples if s.name.endswith("_total")}
    assert per_position == {"0": 3, "1": 2, "2": 1, "3": 1} and all(s.labels["model_name"] == "a" for s in
                                                                     families["vllm:spec_decode_num_drafts"].samples)
    assert list(spec_decode_families("sobrio", [("b", EngineStats())])) == []


@pytest.mark.skipif(cpu_ops() is None, reason="the C++ operators did not build")
def test_the_cpp_target_probabilities_equal_the_pytorch_filters(monkeypatch):
    """`top_k_top_p_probs` keeps the tokens the PyTorch top-k / top-p / min-p filter keeps (masked tokens too)
    and gives them its softmax's probabilities. No ties at the cut here: PyTorch's topk and sort leave their
    order open, the operator keeps equal weights by index (test_sampler.py checks that rule)."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for case in range(40):
        n = int(torch.randint(2, 2000, (1,), generator=gen))
        x = torch.randn(4, n, generator=gen) * float(torch.rand(1, generator=gen)) * 6
        if case % 7 == 0:
            x[torch.rand(4, n, generator=gen) < 0.3] = float("-inf")
            x[:, 0] = 1.0
        rules = meta(4, float(torch.rand(1, generator=gen)) * 1.5 + 0.05,
                     top_k=int(torch.randint(0, 60, (1,), generator=gen)) if case % 2 else 0)
        rules.top_p = [float(torch.rand(1, generator=gen)) if case % 3 else 1.0] * 4
        rules.min_p = [float(torch.rand(1, generator=gen)) * 0.2 if case % 4 == 0 else 0.0] * 4
        cases.append((x, rules, target_probs(x, rules)))
    monkeypatch.setattr("sobrio.sample.sampler.cpu_ops", lambda: None)
    for x, rules, got in cases:
        want = target_probs(x, rules)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        # the kept tokens the same (PyTorch's top-p of 1 also drops the tail whose mass rounds away: ~1e-10 each)
        assert torch.equal((got > 1e-7) | (want > 1e-7), (got > 0) & (want > 0) & ((got > 1e-7) | (want > 1e-7)))
