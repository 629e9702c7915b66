"""Sampler pieces on hand-made logits: filters, penalties, seeds, min_tokens."""

import pytest
import torch

from sobrio.engine.sampling import build_sampling_metadata
from sobrio.errors import InvalidRequestError
from sobrio.layers.cpu_ops import cpu_ops
from sobrio.sample.sampler import Sampler as _Sampler
from sobrio.sample.sampler import filter_top_k_top_p_min_p, greedy_tokens
from sobrio.types.params import SamplingParams
from sobrio.types.request import Request


class Sampler(_Sampler):
    """The sampler fed from requests, as the engine feeds it."""

    def __call__(self, logits, reqs):
        return super().__call__(logits, build_sampling_metadata(reqs))


def _req(**params) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(**params), 10, frozenset({0}))


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_top_k_top_p_min_p(logits, [0], [0.7], [0.0])
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    kept = filter_top_k_top_p_min_p(logits, [0], [0.8], [0.0])  # 0.5 + 0.3 reaches 0.8 exactly
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    kept = filter_top_k_top_p_min_p(logits, [0], [0.1], [0.0])
    assert torch.isfinite(kept).tolist() == [[True, False, False, False]]


def test_top_k_and_min_p():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.3, 0.2]]))
    assert torch.isfinite(filter_top_k_top_p_min_p(logits, [2], [1.0], [0.0])).tolist() == [[False, True, True, False]]
    # min_p 0.6: floor is 0.24 -> keeps 0.4 and 0.3
    assert torch.isfinite(filter_top_k_top_p_min_p(logits, [0], [1.0], [0.6])).tolist() == [[False, True, True, False]]


def _sorted_reference(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The definition: sort each row whole, keep rank < k and strictly-better mass < p (and the best)."""
    out = torch.full_like(logits, float("-inf"))
    for row, (k, p) in enumerate(zip(top_k, top_p)):
        values, order = logits[row].sort(descending=True)
        probs = values.softmax(-1)
        keep = (torch.arange(len(values)) < (k or len(values))) & (probs.cumsum(-1) - probs < p)
        keep[0] = True
        out[row, order[keep]] = values[keep]
    return out


def test_nucleus_from_the_best_candidates_equals_sorting_the_whole_row():
    """Peaked rows cut among the top candidates; flat ones (a nucleus of thousands) and large top-k fall back
    to the full sort; unfiltered rows pass untouched."""
    generator = torch.Generator().manual_seed(0)
    vocab = 5000
    scales = [8.0, 8.0, 0.1, 0.1, 8.0, 3.0, 0.5]
    logits = torch.stack([torch.randn(vocab, generator=generator) * s for s in scales])
    top_k = [0, 40, 0, 0, 3000, 0, 0]
    top_p = [0.9, 1.0, 0.95, 1.0, 0.99, 0.5, 1.0]
    kept = filter_top_k_top_p_min_p(logits, top_k, top_p, [0.0] * len(scales))
    assert torch.equal(kept, _sorted_reference(logits, top_k, top_p))
    assert torch.isfinite(kept[2]).sum() > 1000 and torch.equal(kept[3], logits[3])


def test_greedy_and_penalties():
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.0]])
    sampler = Sampler()
    assert sampler(logits, [_req(temperature=0)])[0].token_id == 1
    req = _req(temperature=0, frequency_penalty=0.5)
    req.output_token_ids = [1]
    assert sampler(logits, [req])[0].token_id == 2
    rep = Request("r", [3], SamplingParams(temperature=0, repetition_penalty=2.0), 10, frozenset())
    rep.output_token_ids = [1]
    assert sampler(logits, [rep])[0].token_id == 2  # 3.0 / 2 = 1.5 < 2.9
    in_prompt = Request("r", [1], SamplingParams(temperature=0, repetition_penalty=2.0), 10, frozenset())
    assert sampler(logits, [in_prompt])[0].token_id == 2  # the prompt counts for repetition too


def test_min_tokens_forbids_eos():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    assert Sampler()(logits, [_req(temperature=0, min_tokens=2)])[0].token_id == 1
    assert Sampler()(logits, [_req(temperature=0)])[0].token_id == 0


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(1, 100)
    alone = [Sampler()(logits, [_req(seed=7)])[0].token_id for _ in range(1)]
    batch = Sampler()(logits.repeat(5, 1), [_req(), _req(seed=3), _req(seed=7), _req(), _req()])
    assert batch[2].token_id == alone[0]


def test_logprobs_report_rank_and_top_n():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    tok = Sampler()(logits, [_req(temperature=0, logprobs=2)])[0]
    ref = logits.log_softmax(-1)[0]
    assert tok.token_id == 0 and tok.rank == 1
    assert tok.logprob == pytest.approx(ref[0].item())
    assert [t for t, _ in tok.top_logprobs] == [0, 1]


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=-3), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(temperature=-1), dict(n=0), dict(top_k=-2), dict(logprobs=-1)])
def test_bad_params_raise_typed_errors(bad):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**bad)
    assert err.value.param == next(iter(bad))


def test_a_step_with_no_rows_samples_nothing_and_leaves_its_logits_alone():
    """A chunked-prefill step where no request reaches its last prompt token has no rows to sample; the
    engine's logits are inference tensors, which no path may update in place without copying them first."""
    with torch.inference_mode():
        logits = torch.randn(0, 100)
    assert Sampler()(logits, []) == []


@pytest.mark.skipif(cpu_ops() is None, reason="the C++ operators did not build")
@pytest.mark.parametrize("width", [1, 7, 16, 17, 49152, 49155])
def test_the_cpp_greedy_argmax_equals_torch_max(width):
    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(40, width, generator=gen)
    logits[1] = 3.0  # a row of ties: the first
    logits[2] = float("-inf")
    logits[3, width // 2] = float("nan")  # a NaN anywhere wins, as in torch.max
    logits[4, -1] = float("nan")
    logits[5, -1], logits[5, width // 3] = 1e9, 1e9  # the same largest value twice: the earlier one
    logits[6, -1] = float("inf")
    logits[7] = torch.randint(-3, 3, (width,), generator=gen).float()  # many ties across lanes
    want = logits.max(dim=-1).indices
    assert torch.equal(cpu_ops().argmax_rows(logits), want)
    assert torch.equal(greedy_tokens(logits), want)
    wide = torch.randn(40, width + 5, generator=gen)  # rows with a stride past their width
    assert torch.equal(cpu_ops().argmax_rows(wide[:, :width]), wide[:, :width].max(dim=-1).indices)


def test_the_cpp_greedy_argmax_refuses_what_it_cannot_read():
    if cpu_ops() is None:
        pytest.skip("the C++ operators did not build")
    for bad in (torch.randn(4, 8).bfloat16(), torch.randn(8), torch.randn(4, 8).T, torch.randn(4, 0)):
        with pytest.raises(RuntimeError, match="argmax_rows"):
            cpu_ops().argmax_rows(bad)


def _kept_inverse_cdf(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                      uniform: float) -> int:
    """The token `_keep_top_k_top_p`'s rules keep and an inverse CDF in vocabulary order draws, in float64:
    ranks by decreasing weight (equal weights by index), rank r kept while r < k and the weight before it is
    below top_p of the total, then min_p of the largest."""
    x = x.double()
    n = x.numel()
    w = torch.where(x > float("-inf"), ((x - x[x > float("-inf")].max()) / temperature).exp(), torch.zeros_like(x))
    order = sorted(range(n), key=lambda i: (-w[i].item(), i))
    ranked = w[order]
    before = ranked.cumsum(0) - ranked
    keep_ranked = (torch.arange(n) < (top_k if 0 < top_k < n else n)) & (before < top_p * w.sum() if top_p < 1
                                                                          else torch.ones(n, dtype=torch.bool))
    keep_ranked[0] = True
    keep = torch.zeros(n, dtype=torch.bool)
    keep[order] = keep_ranked
    cdf = torch.where(keep & (w >= min_p) & (w > 0), w, torch.zeros_like(w)).cumsum(0)
    return int((cdf > uniform * cdf[-1]).nonzero()[0])


@pytest.mark.skipif(cpu_ops() is None, reason="the C++ operators did not build")
def test_the_cpp_sampler_draws_what_the_filtered_inverse_cdf_draws():
    """Temperature, top-k, top-p and min-p in `sample_rows` against the float64 rules, on rows with ties,
    -inf (masked) tokens, flat and peaked weights, nuclei wider than one bucket of its histogram."""
    gen = torch.Generator().manual_seed(0)
    for case in range(120):
        n = int(torch.randint(1, 3000, (1,), generator=gen))
        x = torch.randn(n, generator=gen) * float(torch.rand(1, generator=gen)) * 6
        if case % 5 == 0:
            x = x.round()  # many equal weights, some at the cut
        if case % 7 == 0:
            x[torch.rand(n, generator=gen) < 0.3] = float("-inf")
            x[0] = 1.0
        temperature = float(torch.rand(1, generator=gen)) * 1.5 + 0.05
        top_k = int(torch.randint(0, 60, (1,), generator=gen)) if case % 2 else 0
        top_p = float(torch.rand(1, generator=gen)) if case % 3 else 1.0
        min_p = float(torch.rand(1, generator=gen)) * 0.2 if case % 4 == 0 else 0.0
        uniform = torch.rand(8, generator=gen)
        got = cpu_ops().sample_rows(x.expand(8, n), torch.full((8,), temperature), torch.full((8,), top_k),
                                    torch.full((8,), top_p), torch.full((8,), min_p), uniform)
        want = [_kept_inverse_cdf(x, temperature, top_k, top_p, min_p, float(u)) for u in uniform]
        assert got.tolist() == want, (case, n, temperature, top_k, top_p, min_p)


@pytest.mark.parametrize("path", ["cpp", "pytorch"])
def test_top_p_and_temperature_draw_from_the_renormalized_nucleus(path, monkeypatch):
    """Both sampling paths (the C++ operator and the PyTorch one beside it) draw each nucleus token as often as
    its renormalized probability says, and never one outside it."""
    if path == "cpp" and cpu_ops() is None:
        pytest.skip("the C++ operators did not build")
    if path == "pytorch":
        monkeypatch.setattr("sobrio.sample.sampler.cpu_ops", lambda: None)
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = (probs.log() * 2).expand(4000, 4)  # at temperature 2 the probabilities above
    tokens = [t.token_id for t in Sampler()(logits, [_req(temperature=2.0, top_p=0.7, seed=i) for i in range(4000)])]
    counts = torch.bincount(torch.tensor(tokens), minlength=4) / len(tokens)
    assert counts[0] == 0 and counts[2] == 0  # outside the nucleus {1, 3} (0.8 >= 0.7)
    assert abs(counts[1].item() - 0.625) < 0.03 and abs(counts[3].item() - 0.375) < 0.03


def test_the_cpp_sampler_refuses_what_it_cannot_draw():
    if cpu_ops() is None:
        pytest.skip("the C++ operators did not build")
    x, one = torch.randn(2, 8), torch.ones(2)
    k = torch.zeros(2, dtype=torch.long)
    for bad in ((x, one * 0, k, one, one * 0, one * 0.5), (x, one, k, one, one * 0, one),  # temperature 0, u = 1
                (x.bfloat16(), one, k, one, one * 0, one * 0.5), (x, one[:1], k, one, one * 0, one * 0.5)):
        with pytest.raises(RuntimeError, match="sample_rows"):
            cpu_ops().sample_rows(*bad)
