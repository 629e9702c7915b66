"""Grammars are bounded at the edge (issue 40): any schema, regex or Lark grammar is a 200 or a 400 naming the
field, never a 5xx; recursive schemas work (llguidance supports them)."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sobrio.errors import InvalidRequestError
from sobrio.structured.edge import MAX_SPEC_CHARS, GrammarGate
from sobrio.types.params import StructuredOutputsParams

SMOL = "smollm2-135m"
RECURSIVE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                              "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
             "required": ["name", "child"], "additionalProperties": False}


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", json={"model": SMOL, "prompt": "JSON:", "max_tokens": 3,
                                                                "temperature": 0, **body}, timeout=120)


def assert_200_or_400(resp: httpx.Response, field: str) -> None:
    assert resp.status_code in (200, 400), (resp.status_code, resp.text[:300])
    if resp.status_code == 400:
        assert resp.json()["error"]["param"] == field, resp.text[:300]


@pytest.mark.parametrize("body, field", [
    ({"structured_outputs": {"json": RECURSIVE}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "tree", "schema": RECURSIVE}}},
     "response_format"),
    ({"structured_outputs": {"regex": "a{1000}{1000}"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": 'start: x{100000}\nx: "ab" | "c"'}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": 'start: "a"{1000}{1000}'}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"$ref": "#/definitions/missing"}}}, "structured_outputs"),
])
def test_the_issues_grammars_are_200_or_400(server, body, field):
    resp = post(server, body)
    assert_200_or_400(resp, field)
    if "json" in body.get("structured_outputs", {}) and body["structured_outputs"]["json"] is RECURSIVE:
        assert resp.status_code == 200, resp.text[:300]  # recursion is supported: it must run


def test_a_recursive_schema_produces_its_recursive_json(server):
    resp = post(server, {"structured_outputs": {"json": RECURSIVE}, "max_tokens": 120})
    assert resp.status_code == 200, resp.text[:300]
    choice = resp.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        value = json.loads(choice["text"])
        assert set(value) == {"name", "child"}


# ---- a bounded fuzz of pathological grammars through the server ----
counts = st.sampled_from([0, 1, 2, 50, 1000, 65535, 10**6])
atoms = st.sampled_from(["a", "[a-z]", ".", "\\d", "(a|b)", "\\w+", "[^x]", "(", ")", "\\1", "(?=a)", "[z-a]", "é"])


@st.composite
def regexes(draw) -> str:
    parts = []
    for atom in draw(st.lists(atoms, min_size=1, max_size=4)):
        for _ in range(draw(st.integers(0, 2))):
            atom = f"({atom}){{{draw(counts)}}}" if draw(st.booleans()) else f"{atom}{{{draw(counts)},}}"
        parts.append(atom)
    return "|".join(parts) if draw(st.booleans()) else "".join(parts)


leaf_schemas = st.one_of(
    st.builds(lambda n: {"type": "string", "minLength": n, "maxLength": n}, counts),
    st.builds(lambda n: {"type": "array", "items": {"$ref": "#"}, "minItems": n}, counts),
    st.builds(lambda r: {"type": "string", "pattern": r}, regexes()),
    st.builds(lambda r: {"type": "string", "format": r}, st.sampled_from(["date-time", "email", "nonsense"])),
    st.just({"$ref": "#"}), st.just({"$ref": "#/nowhere"}), st.just({"type": "integer", "minimum": 5, "maximum": 1}),
    st.just({"type": "wat"}), st.just({"enum": []}), st.just({"not": {}}),
)
schemas = st.recursive(leaf_schemas, lambda inner: st.one_of(
    st.builds(lambda p: {"type": "object", "properties": p, "required": list(p)},
              st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3)),
    st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)),
    st.builds(lambda x: {"definitions": {"d": x}, "$ref": "#/definitions/d"}, inner),
), max_leaves=5)
rules = st.sampled_from(['"a"', "x", "start", '"a"{N}', "x{N}", "/[a-z]{N}/", '("a" | "b")*', "undefined_rule",
                         '"a"{N,}', "%ignore", "(start start)"])


@st.composite
def lark_grammars(draw) -> str:
    body = " ".join(draw(rules).replace("N", str(draw(counts))) for _ in range(draw(st.integers(1, 3))))
    alt = " ".join(draw(rules).replace("N", str(draw(counts))) for _ in range(draw(st.integers(1, 2))))
    return f'start: {body} | "end"\nx: {alt} | "x"\n'


constraints = st.one_of(st.builds(lambda r: {"regex": r}, regexes()),
                        st.builds(lambda s: {"json": s}, schemas),
                        st.builds(lambda g: {"grammar": g}, lark_grammars()))


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(constraint=constraints)
def test_fuzzed_grammars_never_get_a_5xx(server, constraint):
    assert_200_or_400(post(server, {"structured_outputs": constraint}), "structured_outputs")


@pytest.mark.exhaustive
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(constraint=constraints)
def test_more_fuzzed_grammars_never_get_a_5xx(server, constraint):
    assert_200_or_400(post(server, {"structured_outputs": constraint}), "structured_outputs")


# ---- the gate itself ----
@pytest.fixture(scope="module")
def gate():
    from sobrio.loader.load import load_model_files

    tokenizer = load_model_files(SMOL).tokenizer
    gate = GrammarGate(lambda: tokenizer, timeout=10.0)
    yield gate
    gate.shutdown()


def test_the_gate_bounds_time_and_size(gate):
    gate.check(StructuredOutputsParams(json=RECURSIVE), [0])  # recursion compiles
    gate.timeout = 0.001
    try:
        with pytest.raises(InvalidRequestError, match="longer than") as err:
            gate.check(StructuredOutputsParams(regex="a{1000}{1000}"), [0])  # ~3 s on Zen 4
        assert err.value.param == "structured_outputs"
    finally:
        gate.timeout = 10.0
    with pytest.raises(InvalidRequestError, match="characters"):
        gate.check(StructuredOutputsParams(regex="a" * (MAX_SPEC_CHARS + 1)), [0])
    gate.check(StructuredOutputsParams(regex="[0-9]{3}"), [0])  # a fresh worker serves the next one
