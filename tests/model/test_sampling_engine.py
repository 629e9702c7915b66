"""Sampling through the real engine: distribution, seeds inside busy batches, stop strings, detokenizing."""

import pytest
import torch
from scipy.stats import chisquare

from sobrio import SamplingParams
from sobrio.engine.detokenize import IncrementalDetokenizer
from tests.model.reference import hf_greedy


def expected_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The top-p nucleus of softmax(logits / T), renormalized; written independently of the sampler."""
    probs = (logits.double() / temperature).softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    cut = int((sorted_probs.cumsum(-1) < top_p).sum()) + 1
    expected = torch.zeros_like(probs)
    expected[order[:cut]] = sorted_probs[:cut] / sorted_probs[:cut].sum()
    return expected


def test_first_token_distribution_matches_filtered_softmax(smollm2):
    # one block and one token: every draw after the first reads the block from the prefix cache and computes
    # one position (a third of the time of a 4-token prompt computed whole)
    text = "I asked my friends what they like. Lucia told me that her favourite colour is"
    prompt = smollm2.get_tokenizer()(text).input_ids
    assert len(prompt) == smollm2.engine.config.cache_config.block_size + 1
    _, logits = hf_greedy("smollm2-135m", tuple(prompt), 1)
    expected = expected_distribution(logits[0], 0.8, 0.9)
    draws = 2000
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=1, seed=s) for s in range(draws)]
    outputs = smollm2.generate([{"prompt_token_ids": prompt}] * draws, params, use_tqdm=False)
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outputs]), minlength=len(expected))
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token outside the top-p nucleus"
    exp_counts = expected[support] * draws
    obs = counts[support].double()
    big = exp_counts >= 5  # merge rare tokens into one bin so the chi-square approximation holds
    f_obs = torch.cat([obs[big], obs[~big].sum().view(1)]).tolist()
    f_exp = torch.cat([exp_counts[big], exp_counts[~big].sum().view(1)]).tolist()
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    assert len(f_exp) >= 3
    assert chisquare(f_obs, f_exp).pvalue > 0.001


def test_same_seed_same_text_alone_or_in_busy_batch(smollm2):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = smollm2.generate("Tell me a story about a fox.", seeded, use_tqdm=False)[0].outputs[0].text
    noise = [SamplingParams(temperature=1.0, max_tokens=30 + i) for i in range(6)]
    prompts = [f"Noise prompt number {i} about cats" for i in range(6)]
    batch = smollm2.generate(prompts[:3] + ["Tell me a story about a fox."] + prompts[3:],
                             noise[:3] + [seeded] + noise[3:], use_tqdm=False)
    assert batch[3].outputs[0].text == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True)
    assert smollm2.generate("Tell me a story about a fox.", other_seed, use_tqdm=False)[0].outputs[0].text != alone


def test_stop_string_cuts_exactly(smollm2):
    prompt = "List the days of the week, separated by commas:"
    full = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[6:9]
    cut = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop, "zzzz"]),
                           use_tqdm=False)[0].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=stop,
                                                   include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(smollm2):
    prompt = "Count: one, two, three,"
    full = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop_id = full.token_ids[3]
    cut = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
                           use_tqdm=False)[0].outputs[0]
    assert cut.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_id


def test_streamed_deltas_never_split_utf8_nor_show_stop(smollm2):
    tokenizer = smollm2.get_tokenizer()
    text = "Caffè, naïve 東京 🚀 done. STOP here"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, SamplingParams(stop=["STOP"]))
    pieces = []
    for token_id in ids:
        stop = detok.add(token_id)
        pieces.append(detok.delta(stop is not None))
        if stop:
            break
    assert "".join(pieces) == text[: text.index("STOP")]
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("n", [1, 3])
def test_n_sequences_greedy_identical(smollm2, n):
    outs = smollm2.generate("Name a fruit:", SamplingParams(n=n, temperature=0, max_tokens=8), use_tqdm=False)
    texts = [c.text for c in outs[0].outputs]
    assert len(texts) == n and len(set(texts)) == 1
    assert [c.index for c in outs[0].outputs] == list(range(n))
