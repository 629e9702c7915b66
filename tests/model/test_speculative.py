"""Speculative decoding through the real engine: greedy output identical with drafts on and off (both models,
prefix cache warm, prompts chunked, across preemption), every KV block back after runs with many rejections,
and at temperature 1 the tokens after accepted drafts distributed as the target's."""

from pathlib import Path

import pytest
import torch

from sobrio import LLM, SamplingParams
from sobrio.errors import ConfigError
from sobrio.speculative.medusa import DraftHeads, DraftHeadsConfig
from tests.conftest import engine_kwargs
from tests.model.reference import hf_greedy, mixed_prompts
from tests.unit.test_rejection import _chi_square_pvalue

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
         "disable_by_batch_size": None, "min_acceptance_rate": 0.0}
LAYER_SKIP = {"method": "layer_skip", "num_speculative_tokens": 3, "disable_by_batch_size": None,
              "min_acceptance_rate": 0.0}  # exit_layer unset: half the model's layers
# SmolLM2 drafting for itself in 8 bits: the only smaller model of its tokenizer here, and one that errs
DRAFT_MODEL = {"method": "draft_model", "model": "smollm2-135m", "quantization": "int8-weight-only",
               "num_speculative_tokens": 3, "disable_by_batch_size": None, "min_acceptance_rate": 0.0}
EAGLE = {"method": "eagle", "num_speculative_tokens": 3, "disable_by_batch_size": None,
         "min_acceptance_rate": 0.0, "min_draft_confidence": 0.0}  # "model": the echo_eagle fixture's folder
GREEDY = SamplingParams(temperature=0, max_tokens=32)
TEXT = ("The committee met on Tuesday to review the budget. It approved the new library, delayed the road repairs "
        "until spring, and asked the treasurer for a report on the water bills. ")


def _with_head(method: dict, request) -> dict:
    """The EAGLE config with its head's folder (a fixture, made once per module); other methods as they are."""
    if method["method"] != "eagle":
        return method
    return {**method, "model": str(request.getfixturevalue("echo_eagle"))}


@pytest.fixture(scope="module")
def echo_eagle(tmp_path_factory, smollm2) -> Path:
    """An EAGLE head that passes the target's feature through (fc reads only the feature, the layer's output
    projections are zero, its draft vocabulary the whole vocabulary): its first draft is the target's own
    argmax at the newest computed position, i.e. the token just produced, exactly when the head reads that
    position's feature; later drafts repeat it. Sometimes right (repeats), and a check of the alignment."""
    from sobrio.draft_training.eagle import EagleTrainee
    from sobrio.speculative.eagle import layer_config

    target = smollm2.engine.runner.model
    rows = target.lm_head_weight().float()
    config = layer_config(target.config, rows.shape[0])
    head = EagleTrainee(config, rows, None, rows)
    d = rows.shape[1]
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, d:] = torch.eye(d)
        head.fc.bias.zero_()
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    folder = tmp_path_factory.mktemp("eagle")
    head.save(folder, config, torch.arange(rows.shape[0]), "smollm2-135m", rows.shape[0])
    return folder


def test_the_eagle_head_reads_the_feature_of_the_newest_position(smollm2, echo_eagle):
    """With the echo head, every first draft must be the request's newest token: the head got the feature
    the target produced that token from (an off-by-one, or another request's rows, would draft others)."""
    prompts = [{"prompt_token_ids": p} for p in grounded_prompts(smollm2.get_tokenizer())]
    spec = LLM("smollm2-135m", **engine_kwargs(speculative_config={**EAGLE, "model": str(echo_eagle)},
                                                max_num_batched_tokens=64))
    proposer, seen = spec.engine.core.speculator.proposer, []
    draft = proposer.draft

    def recording(reqs, num_tokens, starts, features, min_confidence):
        drafts = draft(reqs, num_tokens, starts, features, min_confidence)
        seen.extend((req.output_token_ids[-1], tokens) for req, tokens in zip(reqs, drafts))
        return drafts

    proposer.draft = recording
    expected = _plain_ids(smollm2, prompts, GREEDY)
    assert _ids(spec.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert len(seen) > 50
    assert sum(tokens[0] == newest for newest, tokens in seen) >= 0.95 * len(seen)
    assert all(len(set(tokens)) == 1 for _, tokens in seen)  # its own guess fed back: the same feature again


def grounded_prompts(tokenizer) -> list[list[int]]:
    """Prompts whose answers copy their input (where prompt lookup drafts), and some that do not."""
    asks = [f"Repeat the following text word for word.\n\n{TEXT}\n\nRepeated text:\n",
            f"{TEXT}\n\nCopy the first sentence of the text above:",
            "def area(width, height):\n    return width * height\n\ndef perimeter(width, height):\n"
            "    return 2 * (width + height)\n\n# The same two functions again:\ndef area(width, height):\n"]
    return [tokenizer(a).input_ids for a in asks] + mixed_prompts(tokenizer)[2:4]


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


_PLAIN: dict = {}


def _plain_ids(llm: LLM, prompts: list[dict], params: SamplingParams) -> list[list[int]]:
    """The plain engine's greedy tokens, once per (engine, prompt ids, params) in this module: most tests here
    compare against the same reference (a cache salt does not change greedy tokens)."""
    key = (id(llm), tuple(tuple(p["prompt_token_ids"]) for p in prompts), repr(params))
    if key not in _PLAIN:
        _PLAIN[key] = _ids(llm.generate(prompts, params, use_tqdm=False))
    return _PLAIN[key]


def _no_blocks_held(llm: LLM) -> bool:
    pool = llm.engine.scheduler.pool
    return pool.num_free == pool.num_blocks and all(b.ref_count == 0 for b in pool.blocks)


# Gemma's layer skip (its sliding windows while drafting into its own cache) costs ~70 s on 2 cores: behind
# the exhaustive marker; Gemma's windows under drafts stay covered by gemma3-ngram, layer skip by smollm2's
@pytest.mark.parametrize("alias, method", [
    ("smollm2-135m", NGRAM), ("gemma3-270m", NGRAM), ("smollm2-135m", LAYER_SKIP),
    pytest.param("gemma3-270m", LAYER_SKIP, marks=pytest.mark.exhaustive),
    ("smollm2-135m", DRAFT_MODEL), ("smollm2-135m", EAGLE)],
    ids=["smollm2-ngram", "gemma3-ngram", "smollm2-layer_skip", "gemma3-layer_skip", "smollm2-draft_model",
         "smollm2-eagle"])
def test_greedy_output_is_the_same_with_drafts_chunked_and_cached(alias, method, request):
    """Prompt lookup drafts the copies; the model's first layers draft into its own KV cache, at slots taken
    ahead of the scheduler, which the verifying step must find and rewrite whatever was accepted (Gemma's
    sliding windows too); a draft model's own KV cache must hold every position the target's does, prefix
    cache hits included."""
    plain = request.getfixturevalue({"smollm2-135m": "smollm2", "gemma3-270m": "gemma3"}[alias])
    method = _with_head(method, request)
    prompts = [{"prompt_token_ids": p} for p in grounded_prompts(plain.get_tokenizer())]
    if alias == "gemma3-270m":  # its 262k-row head makes each draft dear: a copy, code and a free answer, batched
        prompts = prompts[1:4]
    expected = _plain_ids(plain, prompts, GREEDY)
    # 64-token steps: the long prompts come in chunks, and drafts share steps with them
    spec = LLM(alias, **engine_kwargs(speculative_config=method, max_num_batched_tokens=64))
    assert _ids(spec.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert _ids(spec.generate(prompts, GREEDY, use_tqdm=False)) == expected  # prompts now in the prefix cache
    if alias != "gemma3-270m":
        one_at_a_time = [spec.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:2]]
        assert one_at_a_time == expected[:2]
    stats = spec.engine.core.stats()["spec_decode"]
    assert stats["num_draft_tokens"] > 100
    if method["method"] in ("ngram", "draft_model"):  # the copies were drafted; an 8-bit copy mostly agrees
        assert stats["num_accepted_tokens"] > 0.3 * stats["num_draft_tokens"]
    assert _no_blocks_held(spec)


def test_an_exit_layer_past_the_model_is_refused():
    with pytest.raises(ConfigError, match="exit_layer 30 must be below the model's 30 layers"):
        LLM("smollm2-135m", **engine_kwargs(speculative_config={**LAYER_SKIP, "exit_layer": 30}))


def test_a_draft_model_with_another_tokenizer_is_refused():
    with pytest.raises(ConfigError, match="draft model 'gemma3-270m' has another tokenizer than 'smollm2-135m'"):
        LLM("smollm2-135m", **engine_kwargs(speculative_config={**DRAFT_MODEL, "model": "gemma3-270m"}))


# Layer skip and EAGLE across preemption (~30 s each on 2 cores) behind the exhaustive marker: the default run
# keeps a method with a KV cache of its own (the draft model's) and one without (prompt lookup); layer skip's
# and EAGLE's slots ahead of the scheduler stay covered by the chunked and cached test above
@pytest.mark.parametrize("method", [NGRAM, pytest.param(LAYER_SKIP, marks=pytest.mark.exhaustive), DRAFT_MODEL,
                                    pytest.param(EAGLE, marks=pytest.mark.exhaustive)],
                         ids=["ngram", "layer_skip", "draft_model", "eagle"])
def test_greedy_output_is_the_same_across_preemption(smollm2, method, request):
    tokenizer = smollm2.get_tokenizer()
    prompts = [{"prompt_token_ids": p, "cache_salt": str(i)} for i, p in enumerate(grounded_prompts(tokenizer))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _plain_ids(smollm2, prompts, params)
    # 12 blocks of 16 = 192 tokens of KV for the 376 the five need at their end: preemption is certain
    draft_layers = {"draft_model": 30, "eagle": 1}.get(method["method"], 0)  # the draft's own KV, per block
    block_bytes = 2 * (30 + draft_layers) * 16 * 3 * 64 * 4
    tight = LLM("smollm2-135m", **engine_kwargs(kv_cache_memory=12 * block_bytes, max_model_len=192,
                                                speculative_config=_with_head(method, request)))
    assert tight.engine.scheduler.pool.num_blocks == 12
    assert _ids(tight.generate(prompts, params, use_tqdm=False)) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    counted = "num_accepted_tokens" if method is NGRAM else "num_draft_tokens"  # early exits guess poorly
    assert tight.engine.core.stats()["spec_decode"][counted] > 0
    assert _no_blocks_held(tight)


@pytest.fixture(scope="module")
def smollm2_spec():
    return LLM("smollm2-135m", **engine_kwargs(speculative_config=NGRAM))


@pytest.mark.parametrize("method", [NGRAM, DRAFT_MODEL], ids=["ngram", "draft_model"])
def test_every_block_returns_after_many_rejections_and_stops(method, smollm2_spec):
    """Random sampling rejects most drafts (a greedy draft model's too); stop strings, stop tokens and
    max_tokens cut mid-draft."""
    if method is DRAFT_MODEL:
        smollm2_spec = LLM("smollm2-135m", **engine_kwargs(speculative_config=DRAFT_MODEL))
    tokenizer = smollm2_spec.get_tokenizer()
    prompts = [{"prompt_token_ids": p} for p in grounded_prompts(tokenizer)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=5 + 9 * s, stop=[" the"] if s % 2 else None,
                             logprobs=1 if s == 3 else None)
              for s in range(len(prompts))]
    before = smollm2_spec.engine.core.stats()["spec_decode"]
    outputs = smollm2_spec.generate(prompts, params, use_tqdm=False)
    after = smollm2_spec.engine.core.stats()["spec_decode"]
    rejected = (after["num_draft_tokens"] - before["num_draft_tokens"]) - (
        after["num_accepted_tokens"] - before["num_accepted_tokens"])
    assert rejected > 10
    for out, p in zip(outputs, params):
        completion = out.outputs[0]
        assert len(completion.token_ids) <= p.max_tokens
        assert " the" not in completion.text or not p.stop
        if p.logprobs:
            assert len(completion.logprobs) == len(completion.token_ids)
    assert _no_blocks_held(smollm2_spec)


def test_tokens_after_accepted_drafts_follow_the_targets_distribution(smollm2_spec):
    """At temperature 1, the second output token of a prompt whose first token is likely (" Friday", 0.90),
    among the draws that started with it: distributed as transformers' softmax after prompt + that token
    (",": 0.96, then ".", " (", ...), though prompt lookup drafted it (accepted or not)."""
    tokenizer = smollm2_spec.get_tokenizer()
    week = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. "
    # two weeks: the draws after the first read two of the prompt's three blocks from the prefix cache
    prompt = tokenizer(week * 2 + "Monday, Tuesday, Wednesday, Thursday,").input_ids
    _, first_logits = hf_greedy("smollm2-135m", tuple(prompt), 1)
    first = int(first_logits[0].argmax())
    assert first_logits[0].softmax(-1)[first] > 0.6
    _, second_logits = hf_greedy("smollm2-135m", tuple(prompt + [first]), 1)
    draws = 600
    # max_tokens 3: the first token comes from the prompt's forward, the second is the first a draft can be for
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True) for s in range(draws)]
    before = smollm2_spec.engine.core.stats()["spec_decode"]["num_draft_tokens"]
    outputs = smollm2_spec.generate([{"prompt_token_ids": prompt}] * draws, params, use_tqdm=False)
    assert smollm2_spec.engine.core.stats()["spec_decode"]["num_draft_tokens"] > before + draws // 2
    seconds = [o.outputs[0].token_ids[1] for o in outputs if o.outputs[0].token_ids[0] == first]
    assert len(seconds) > 0.6 * draws
    counts = torch.bincount(torch.tensor(seconds), minlength=second_logits.shape[-1])
    assert _chi_square_pvalue(counts, second_logits[0].double().softmax(-1)) > 0.001


@pytest.mark.parametrize("spec, message", [
    ({"method": "ngram"}, "num_speculative_tokens must be an integer"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": "x"}, "does not support method 'eagle3'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, 'method "eagle" needs "model"'),
    ({"method": "eagle", "num_speculative_tokens": 2, "model": "/nonexistent"}, "holds no EAGLE head"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key(s) lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "1 <= min <= max"),
    ('{"method": ', "must be a JSON object"),
    ({"method": "layer_skip", "num_speculative_tokens": 2, "exit_layer": 0}, "exit_layer must be an integer >= 1"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, 'method "draft_model" needs "model"'),
    ({**DRAFT_MODEL, "quantization": "int3"}, "quantization (the draft model's, or the EAGLE head's) must be one"),
    ({**EAGLE, "model": "x", "quantization": "gguf"}, "must be one of int8, int8-weight-only, int4 or null"),
    ({**EAGLE, "model": "x", "min_draft_confidence": 1.5}, "min_draft_confidence must be in [0, 1]"),
])
def test_bad_speculative_configs_are_refused_naming_the_problem(spec, message):
    with pytest.raises(ConfigError, match="--speculative-config") as exc:
        LLM("smollm2-135m", **engine_kwargs(speculative_config=spec))
    assert message in str(exc.value)


@pytest.fixture(scope="module")
def untrained_heads(tmp_path_factory, smollm2) -> Path:
    """Three draft heads as `sobrio train-draft` starts them (each block the identity, so each guesses the
    target's own next token from h_t), over SmolLM2's first 8,192 token ids: drafts that are sometimes right
    (repeats), enough to exercise acceptance and rejection."""
    head = smollm2.engine.runner.model.lm_head_weight().float()
    vocab = torch.arange(8192)
    config = DraftHeadsConfig(3, head.shape[1], head.shape[0], len(vocab), "smollm2-135m")
    heads = DraftHeads(config, vocab, head[vocab], head[vocab])  # tied: the head's rows are the embedding's
    folder = tmp_path_factory.mktemp("heads")
    heads.save(folder)
    return folder


def test_greedy_output_is_the_same_with_draft_heads(smollm2, untrained_heads):
    prompts = [{"prompt_token_ids": p} for p in grounded_prompts(smollm2.get_tokenizer())]
    expected = _plain_ids(smollm2, prompts, GREEDY)
    medusa = {"method": "medusa", "model": str(untrained_heads), "num_speculative_tokens": 3,
              "disable_by_batch_size": None, "min_acceptance_rate": 0.0}
    spec = LLM("smollm2-135m", **engine_kwargs(speculative_config=medusa, max_num_batched_tokens=64))
    assert _ids(spec.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = spec.engine.core.stats()["spec_decode"]
    assert stats["num_draft_tokens"] > 100 and stats["num_accepted_tokens"] > 0
    assert _no_blocks_held(spec)


def test_draft_heads_for_another_vocabulary_are_refused(tmp_path):
    vocab = torch.arange(16)
    rows = torch.zeros(16, 576)
    DraftHeads(DraftHeadsConfig(2, 576, 32000, 16, "another-model"), vocab, rows, rows).save(tmp_path)
    spec = {"method": "medusa", "model": str(tmp_path), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="trained for a vocabulary of 32000 tokens .* this model has 49152"):
        LLM("smollm2-135m", **engine_kwargs(speculative_config=spec))
    with pytest.raises(ConfigError, match="holds no draft heads"):
        LLM("smollm2-135m", **engine_kwargs(speculative_config={**spec, "model": str(tmp_path / "none")}))
