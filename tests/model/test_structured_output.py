"""Structured output on smollm2-135m, offline: JSON schema (greedy and sampled, mixed with unconstrained rows
that must not feel the mask), regex, choice, Lark and GBNF grammars, json_object; bad specs refused before
queuing; grammars finish requests; nothing left behind after an abort, even mid-compile."""

import json
import pickle
import re
from types import SimpleNamespace

import pytest
import torch

from sobrio import InvalidRequestError, SamplingParams, StructuredOutputsParams
from sobrio.sample.metadata import TokenBitmask
from sobrio.sample.sampler import apply_token_bitmask
from sobrio.structured.backend import GrammarCompiler
from sobrio.structured.manager import StructuredOutputManager

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "colour", "tags", "active"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON:", "Here is a user record in JSON format:", "Write a JSON object:"]
PLAIN_PROMPTS = ["The capital of France is", "One, two, three,"]


def check_person(value) -> None:
    """PERSON's constraints, by hand (no jsonschema here)."""
    assert isinstance(value, dict) and set(value) == set(PERSON["required"])
    assert isinstance(value["name"], str) and 1 <= len(value["name"]) <= 20
    assert type(value["age"]) is int and 0 <= value["age"] <= 120
    assert value["colour"] in ("red", "green", "blue")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 10 for t in value["tags"])
    assert type(value["active"]) is bool


def _drain(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    return finished


def _assert_idle(engine) -> None:
    assert all(size == 0 for size in engine.table_sizes().values()), engine.table_sizes()
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks


@pytest.fixture(scope="module")
def invariant_smollm2():
    """Batch-invariant kernels: a row's logits do not depend on what shares its step, so a sampled row (at
    temperature 1) alone and beside structured rows must be the same unless the mask leaked. (With the
    default kernels a matmul's last bits depend on the step's row count on AVX-512/AMX hosts, and a
    last-bit difference can flip a sampled token.)"""
    from sobrio import LLM
    from tests.conftest import engine_kwargs

    return LLM("smollm2-135m", **engine_kwargs(batch_invariant=True))


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)])
def test_json_schema_validates_and_leaves_unconstrained_rows_alone(invariant_smollm2, sampling):
    smollm2 = invariant_smollm2
    plain = SamplingParams(max_tokens=12, **sampling)
    alone = [o.outputs[0].token_ids for o in smollm2.generate(PLAIN_PROMPTS, plain, use_tqdm=False)]
    structured = SamplingParams(max_tokens=120, structured_outputs=StructuredOutputsParams(json=PERSON), **sampling)
    prompts = [PROMPTS[0], PLAIN_PROMPTS[0], PROMPTS[1], PLAIN_PROMPTS[1], PROMPTS[2]]
    params = [structured, plain, structured, plain, structured]
    outs = smollm2.generate(prompts, params, use_tqdm=False)
    for out in (outs[0], outs[2], outs[4]):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        check_person(json.loads(out.outputs[0].text))
        assert list(json.loads(out.outputs[0].text)) == list(PERSON["properties"])  # the schema's key order
    assert [outs[1].outputs[0].token_ids, outs[3].outputs[0].token_ids] == alone  # the mask did not leak
    _assert_idle(smollm2.engine)


def test_regex_choice_lark_gbnf_and_json_object(smollm2):
    def one(prompt: str, structured: StructuredOutputsParams, **kw) -> str:
        kw = {"max_tokens": 40, "temperature": 1.0, "seed": 3, **kw}
        params = SamplingParams(structured_outputs=structured, **kw)
        out = smollm2.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop", out.text
        return out.text

    for seed in range(3):
        assert re.fullmatch(r"\d{3}-\d{4}", one("Call me at", StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
                                                seed=seed))
    choices = ["yes", "no", 'it\'s "maybe" – ça dépend']
    assert {one("Is the sky blue?", StructuredOutputsParams(choice=choices), seed=s) for s in range(4)} <= set(choices)
    assert re.fullmatch(r"ab+c", one("Letters:", StructuredOutputsParams(grammar='start: "a" B "c"\nB: /b+/')))
    gbnf = 'root ::= "x" [0-9] [0-9]? [0-9]? "y"'
    assert re.fullmatch(r"x\d{1,3}y", one("Code:", StructuredOutputsParams(grammar=gbnf)))
    text = one('JSON: {"ok": true}\nJSON:', StructuredOutputsParams(json_object=True), temperature=0, max_tokens=60)
    assert isinstance(json.loads(text), dict)
    _assert_idle(smollm2.engine)


@pytest.mark.parametrize("structured,words", [
    (dict(json={"type": "foo"}), ["json", "foo"]),
    (dict(json='{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}'), ["json", "nowhere"]),
    (dict(json="{not json"), ["json"]),
    (dict(regex="(ab"), ["regex", "unclosed group"]),
    (dict(grammar="start: foo"), ["grammar", "foo"]),
])
def test_invalid_specs_are_refused_before_queuing(smollm2, structured, words):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**structured))
    with pytest.raises(InvalidRequestError) as info:
        smollm2.generate("x", params, use_tqdm=False)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert info.value.param == "structured_outputs"
    _assert_idle(smollm2.engine)


def test_params_shape_and_pickle():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError):
        StructuredOutputsParams(choice=[])
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON))
    assert pickle.loads(pickle.dumps(params)) == params  # it crosses to the engine-core process
    assert StructuredOutputsParams(json=PERSON).spec == StructuredOutputsParams(json=json.dumps(PERSON)).spec


def test_abort_mid_way_and_mid_compile_leaves_nothing(smollm2):
    engine = smollm2.engine
    params = SamplingParams(max_tokens=200, temperature=0, structured_outputs=StructuredOutputsParams(
        regex=r"[a-z ]{150,200}"))
    engine.add_request("so-abort", "A long story begins", params)
    for _ in range(6):
        engine.step()
    assert engine.core.structured.is_constrained("so-abort")
    assert engine.scheduler.pool.num_free < engine.scheduler.pool.num_blocks
    engine.abort_request("so-abort")
    assert not engine.has_unfinished_requests()
    _assert_idle(engine)
    # aborted while its grammar compiles: never scheduled, nothing kept
    engine.add_request("so-early", "x", SamplingParams(structured_outputs=StructuredOutputsParams(
        regex=r"[0-9]{2,9}z")))
    engine.abort_request("so-early")
    _drain(engine)
    _assert_idle(engine)


def test_mask_allows_eos_only_when_the_grammar_accepts(smollm2):
    tokenizer = smollm2.get_tokenizer()
    eos = tokenizer.eos_token_id
    manager = StructuredOutputManager(GrammarCompiler(lambda: tokenizer))

    class Req:  # what the manager reads of a request
        request_id, eos_token_ids = "r", frozenset({eos})
        sampling_params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="ab|abc"))

    manager.submit(Req)
    manager.wait(30)
    ready, failed = manager.ready()
    assert len(ready) == 1 and not failed
    vocab = 49152 + 64  # a model vocabulary wider than the tokenizer's: the extra ids are never allowed
    other = SimpleNamespace(request_id="other")
    mask = allowed_mask(manager, [other, Req, other], vocab)  # rows 0 and 2 are unconstrained
    assert mask.shape == (3, vocab) and mask[0].all() and mask[2].all()
    assert not mask[1, eos] and not mask[1, 49152:].any()
    allowed = mask[1].nonzero().flatten().tolist()
    assert all(tokenizer.decode([t]) in ("a", "ab", "abc") for t in allowed)
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    assert manager.accept(Req, a) is None and manager.accept(Req, b) is None  # "ab": accepting, "c" may follow
    allowed = allowed_mask(manager, [Req], vocab)[0].nonzero().flatten().tolist()
    assert eos in allowed and all(t == eos or tokenizer.decode([t]) == "c" for t in allowed)
    assert manager.accept(Req, tokenizer.convert_tokens_to_ids("c")) == "stop"
    manager.free("r")
    assert manager.table_sizes() == {"structured_pending": 0, "structured_matchers": 0}
    manager.shutdown()


def allowed_mask(manager: StructuredOutputManager, reqs: list, vocab: int) -> torch.Tensor:
    """bool [len(reqs), vocab]: what the sampler leaves finite once the step's bitmasks are applied."""
    logits = torch.zeros(len(reqs), vocab)
    apply_token_bitmask(logits, manager.allowed_tokens(reqs))
    return logits != float("-inf")


def test_bitmask_applies_to_its_rows_only():
    bits = torch.tensor([[0b101, -1], [0, -(1 << 31)]], dtype=torch.int32)  # bit 31: the sign
    logits = torch.zeros(3, 70)
    apply_token_bitmask(logits, TokenBitmask(torch.tensor([2, 0]), bits))
    allowed = logits != float("-inf")
    assert allowed[2].nonzero().flatten().tolist() == [0, 2, *range(32, 64)]  # past 64: no word, not allowed
    assert allowed[0].nonzero().flatten().tolist() == [63]
    assert allowed[1].all()  # an unconstrained row keeps the whole vocabulary


def test_finished_requests_leave_no_grammar_state_and_the_cache_stays_bounded(smollm2):
    """Engine-core memory under a load of ever new schemas: every request's matcher and mask go at finish or
    abort (also one aborted while its grammar compiles), and the compiled grammars kept never pass the bound."""
    tokenizer = smollm2.get_tokenizer()
    compiler = GrammarCompiler(lambda: tokenizer, cache_size=3)
    manager = StructuredOutputManager(compiler)
    reqs = []
    for i in range(8):  # 8 new schemas, one twice
        name = f"field{i % 7}"
        schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
        reqs.append(SimpleNamespace(request_id=f"r{i}", eos_token_ids=frozenset({tokenizer.eos_token_id}),
                                    sampling_params=SamplingParams(structured_outputs=StructuredOutputsParams(
                                        json=schema))))
        manager.submit(reqs[-1])
    manager.free("r7")  # aborted while it waits for its compile
    while manager.has_pending():
        manager.wait(30)
        ready, failed = manager.ready()
        assert not failed
    for req in reqs[:7]:  # each runs a few tokens (masks computed ahead and in a batch), then finishes
        assert manager.is_constrained(req.request_id)
        manager.forced_token(req)
    manager.allowed_tokens(reqs[:7])
    for req in reqs[:7]:
        manager.free(req.request_id)
    assert manager.table_sizes() == {"structured_pending": 0, "structured_matchers": 0}
    assert not manager.next_masks and len(compiler._cache) <= 3
    assert compiler.hits + compiler.misses >= 7
    manager.shutdown()
