"""Property tests of structured output on both models, sampled at temperature 1.0: the outputs of 200
hypothesis-generated JSON schemas (tests/model/schema_strategies.py; Gemma: the first 100) parse and
validate with `jsonschema`; regex outputs fullmatch their regex and choice outputs are one of the choices.

Each model generates all of this file's requests in one batch (a module fixture; 64 in flight at once), about
a hundred steps per model. The drawn schemas bound their outputs, so every one must finish ("stop") and
validate. A JSON number without multipleOf may have any number of digits (at temperature 1.0 a small model
often goes on and on): a few such requests ride along with a small max_tokens, and each either validates or
ends with finish_reason "length", never claiming to be complete.
"""

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer

from sobrio import SamplingParams, StructuredOutputsParams
from tests.model.schema_strategies import draw_schemas

MODELS = {"smollm2-135m": "smollm2", "gemma3-270m": "gemma3"}  # alias -> the session fixture (tests/conftest.py)
NUM_SCHEMAS = 200
GEMMA_SCHEMAS = 100  # each Gemma step masks and samples a 262k-token vocabulary per row: half the draws
MAX_TOKENS = 128  # a drawn schema's output has at most MAX_OUTPUT_CHARS (112) characters
JSON_PROMPTS = ["JSON:", "Here is the record, as JSON:", "Output:", "The answer in JSON format is"]

REGEXES = [
    r"\d{3}-\d{4}",
    r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?",
    r"(cat|dog|bird)s?",
    r"-?\d{1,4}(\.\d{1,2})?",
    r"[a-f0-9]{8}",
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"[a-z]{1,8}@[a-z]{2,6}\.(com|org|net)",
    r"(true|false|null)",
    r"[äöüß]{1,3}!",
    r"\((\+|-|\*) [0-9] [0-9]\)",
    r"[^\n\"]{0,12}\.",
    r"(ab|a)(bc|c)?d{0,2}",
    r"\"[a-z ]{0,10}\"",
    r"(0|[1-9][0-9]{0,2})(,[0-9]{3}){0,2}",
    r"😀{1,3}|🎉",
]
CHOICES = [
    ["yes", "no"],
    ["a", "ab", "abc"],  # each a prefix of the next
    ["red", "green", "blue", "light green"],
    ['it\'s "quoted"', "back\\slash", "new\nline"],
    ["ça dépend", "naïve", "日本語", "😀"],
    ["positive", "negative", "neutral"],
    ["The quick brown fox jumps over the lazy dog", "The quick brown cat"],
    ["1", "10", "100", "-1"],
    [" leading space", "trailing space ", "  "],
    ["{", "}", "[]", "<|im_end|>"],
]
PROMPTS = ["Answer:", "The value is", "Q: pick one.\nA:"]
UNBOUNDED = [  # numbers whose digits nothing bounds: each output validates or is cut by max_tokens
    {"type": "number"},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "object", "properties": {"x": {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1}},
     "required": ["x"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 2},
]
UNBOUNDED_MAX_TOKENS = 20


@pytest.fixture(scope="module")
def schemas() -> list[dict]:
    return draw_schemas(NUM_SCHEMAS)


@pytest.fixture(scope="module", params=list(MODELS))
def generated(request, schemas) -> SimpleNamespace:
    """Everything one model generates for this file, in one batch: the drawn schemas, the unbounded numbers,
    the regexes and the choices (one long batch wastes fewer steps on stragglers than three)."""
    llm = request.getfixturevalue(MODELS[request.param])
    schemas = schemas[:GEMMA_SCHEMAS] if request.param == "gemma3-270m" else schemas
    unbounded = UNBOUNDED
    specs = [StructuredOutputsParams(regex=r) for r in REGEXES for _ in range(2)]
    specs += [StructuredOutputsParams(choice=c) for c in CHOICES for _ in range(3)]
    requests = [(JSON_PROMPTS, StructuredOutputsParams(json=s), MAX_TOKENS) for s in schemas]
    requests += [(JSON_PROMPTS, StructuredOutputsParams(json=s), UNBOUNDED_MAX_TOKENS) for s in unbounded]
    requests += [(PROMPTS, spec, 48) for spec in specs]
    prompts = [texts[i % len(texts)] for i, (texts, _, _) in enumerate(requests)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=spec)
              for i, (_, spec, max_tokens) in enumerate(requests)]
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(size == 0 for size in llm.engine.table_sizes().values()), llm.engine.table_sizes()
    n, u = len(schemas), len(unbounded)
    return SimpleNamespace(json=list(zip(schemas, outputs[:n])), unbounded=list(zip(unbounded, outputs[n:n + u])),
                           specs=list(zip(specs, outputs[n + u:])))


def _loads(text: str):
    """json.loads, refusing duplicate keys (which json.loads would silently collapse)."""
    def pairs(items):
        keys = [k for k, _ in items]
        assert len(keys) == len(set(keys)), f"duplicate keys {keys}"
        return dict(items)

    return json.loads(text, object_pairs_hook=pairs)


def _invalid(schema: dict, out) -> str | None:
    """Why `out` is not a complete JSON text that validates against `schema` (None if it is)."""
    try:
        assert out.finish_reason == "stop", f"finish_reason {out.finish_reason}"
        jsonschema.Draft202012Validator(schema).validate(_loads(out.text))
    except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
        return (f"schema {json.dumps(schema)}\n  output {out.text!r}\n  {type(exc).__name__}: "
                f"{str(exc).splitlines()[0]}")
    return None


def test_sampled_json_validates_for_generated_schemas(generated):
    assert len(generated.json) in (NUM_SCHEMAS, GEMMA_SCHEMAS)
    invalid = [why for schema, out in generated.json if (why := _invalid(schema, out))]
    assert not invalid, f"{len(invalid)} of {len(generated.json)} outputs invalid:\n" + "\n".join(invalid[:5])


def test_unbounded_numbers_validate_or_are_cut(generated):
    invalid = [why for schema, out in generated.unbounded if out.finish_reason != "length"
               and (why := _invalid(schema, out))]
    assert not invalid, "\n".join(invalid)


def test_sampled_regex_and_choice_outputs_always_match(generated):
    assert len(generated.specs) >= 60
    for spec, out in generated.specs:
        assert out.finish_reason == "stop", (spec, out.finish_reason)
        if spec.regex is not None:
            assert re.fullmatch(spec.regex, out.text), (spec.regex, out.text)
        else:
            assert out.text in spec.choice, (spec.choice, out.text)


def test_a_constant_the_tokenizer_cannot_spell_never_claims_completion(smollm2):
    """U+50000 needs the UTF-8 lead byte F1, which SmolLM2's vocabulary lacks: the schema cannot be met, and
    the request ends without "stop" (llguidance allows a token it then refuses: the core finishes the request
    with "error") rather than with text claimed to be complete JSON."""
    schema = {"type": "object", "properties": {"k": {"const": "a\U00050000"}}, "required": ["k"],
              "additionalProperties": False}
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=20, structured_outputs=StructuredOutputsParams(
        json=schema))
    out = smollm2.generate("JSON:", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason != "stop", out.text
    assert all(size == 0 for size in smollm2.engine.table_sizes().values())


@pytest.mark.xfail(strict=True, reason="llguidance accepts an integral exclusiveMinimum itself when the maximum "
                                       "is less than one above it; schema_strategies.numbers avoids the case")
def test_llguidance_exclusive_minimum_bug(smollm2):
    """Found by the property test (output `0` for {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}).
    When this passes, llguidance is fixed: remove the xfail and the workaround in schema_strategies.numbers."""
    tokenizer = smollm2.get_tokenizer()
    llg_tokenizer = from_tokenizer(tokenizer, eos_token=[tokenizer.eos_token_id])
    for schema, text in [({"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}, "0"),
                         ({"type": "number", "exclusiveMinimum": 2, "exclusiveMaximum": 2.25}, "2")]:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
        matcher = LLMatcher(llg_tokenizer, grammar, log_level=0)
        consumed = all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        assert not (consumed and matcher.is_accepting()), f"{json.dumps(schema)} accepts {text}"
