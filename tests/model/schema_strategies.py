"""Hypothesis strategies for bounded JSON schemas, and a deterministic draw of many of them.

`json_schemas()` builds schemas from the keywords applications use: nested objects with required and optional
properties, arrays with minItems/maxItems, enum, const, integers and numbers with (exclusive) bounds, strings
with minLength/maxLength or a pattern, `anyOf`, and `$defs` with `$ref`. Property names and string constants
are drawn partly from arbitrary Unicode (quotes, backslashes, control characters), which the grammar must
escape. Every schema is satisfiable and bounded: strings have a maxLength or a bounded pattern, arrays a
maxItems, objects no additional properties, numbers both bounds and a multipleOf; `max_chars` bounds the
longest output, and schemas past `MAX_OUTPUT_CHARS` are not drawn, so a sampled output is a few dozen tokens
at most (the property test's max_tokens is 128).

`draw_schemas(count)` returns the same `count` distinct schemas every time (hypothesis, derandomized, generate
phase only): the property tests generate them all in one batch, and benchmarks/structured_output.py
compiles them.
"""

import json
import string

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

MAX_OUTPUT_CHARS = 112  # the longest output a drawn schema allows (numbers counted as NUMBER_CHARS)
NUMBER_CHARS = 12
MAX_DEPTH = 3

# Anchored, bounded patterns (JSON Schema patterns search; anchoring makes the bound the pattern's own).
PATTERNS = {
    r"^[a-z]{1,6}$": 6,
    r"^[A-Z][a-z]{0,5}$": 6,
    r"^\d{3}-\d{4}$": 8,
    r"^(red|green|blue)-[0-9]{1,2}$": 8,
    r"^[a-f0-9]{8}$": 8,
    r"^#[0-9A-F]{6}$": 7,
    r"^(yes|no)?$": 3,
    r"^[a-z]+@[a-z]{2,5}\.(com|org)$": None,  # unbounded: needs a maxLength with it
}

ODD_CHARS = '"\\/\n\t\x00\x7féß€😀 '


def spellable(char: str) -> bool:
    """SmolLM2's byte-level vocabulary has no token for the UTF-8 lead bytes F1 and F2, so no token sequence
    spells a character of U+40000..U+BFFFF (all unassigned): a schema whose key or constant holds one cannot
    be satisfied (test_structured_properties.py checks that such a request never claims completion)."""
    return not 0x40000 <= ord(char) < 0xC0000


any_chars = st.characters(exclude_categories=("Cs",)).filter(spellable)  # any Unicode but surrogates
identifiers = st.from_regex(r"[a-z][a-z_0-9]{0,9}", fullmatch=True)
names = st.one_of(  # three in five plain (a key costs tokens: one of any Unicode up to a dozen)
    identifiers,
    identifiers,
    identifiers,
    st.text(alphabet=st.sampled_from(string.ascii_letters + ODD_CHARS), min_size=1, max_size=5),
    st.text(any_chars, min_size=1, max_size=3),
)
short_strings = st.one_of(st.from_regex(r"[a-z]{0,6}", fullmatch=True), st.text(any_chars, max_size=4))
scalars = st.one_of(
    short_strings,
    st.integers(-1000, 1000),
    st.booleans(),
    st.none(),
    st.sampled_from([0.5, -2.25, 1e-3, 3.0]),
)


@st.composite
def strings(draw) -> dict:
    if draw(st.integers(0, 3)) == 0:  # a quarter: a pattern
        pattern = draw(st.sampled_from(sorted(PATTERNS)))
        schema = {"type": "string", "pattern": pattern}
        if PATTERNS[pattern] is None:
            schema["maxLength"] = draw(st.integers(12, 16))
        return schema
    low = draw(st.integers(0, 4))
    return {"type": "string", "minLength": low, "maxLength": draw(st.integers(max(low, 1), 10))}


@st.composite
def integers(draw) -> dict:
    low = draw(st.integers(-10**6, 10**6))
    high = low + draw(st.sampled_from([2, 5, 10, 100, 10**4]))
    schema = {"type": "integer"}
    schema["exclusiveMinimum" if draw(st.booleans()) else "minimum"] = low
    schema["exclusiveMaximum" if draw(st.booleans()) else "maximum"] = high
    return schema


@st.composite
def numbers(draw) -> dict:
    """Bounds two decimals long, and a dyadic multipleOf (exact in binary, so `jsonschema` checks it
    exactly): without one, a sampled number may have any number of digits (test_structured_properties.py
    samples a few such numbers apart, as UNBOUNDED)."""
    low = draw(st.floats(-1000, 1000, allow_nan=False, allow_infinity=False).map(lambda x: round(x, 2)))
    width = draw(st.sampled_from([0.5, 1.0, 10.0, 250.0]))
    high = round(low + width, 2)
    exclusive_low = draw(st.booleans())
    if exclusive_low and low == int(low) and high < low + 1:
        # llguidance 1.x accepts the bound itself ("0" for exclusiveMinimum 0, maximum 0.5): pinned by
        # test_llguidance_exclusive_minimum_bug in test_structured_properties.py; drawn when that is fixed
        high = low + 1
    schema = {"type": "number", "multipleOf": draw(st.sampled_from([0.125, 0.25] + [0.5, 2.5] * (width > 1)))}
    schema["exclusiveMinimum" if exclusive_low else "minimum"] = low
    schema["exclusiveMaximum" if draw(st.booleans()) else "maximum"] = high
    return schema


LEAF_KINDS = ("string", "string", "integer", "number", "boolean", "null", "enum", "const")


@st.composite
def leaves(draw, refs: tuple[str, ...] = ()) -> dict:
    kind = draw(st.sampled_from(LEAF_KINDS + (("$ref",) if refs else ())))
    if kind == "string":
        return draw(strings())
    if kind == "integer":
        return draw(integers())
    if kind == "number":
        return draw(numbers())
    if kind == "enum":
        return {"enum": draw(st.lists(scalars, min_size=1, max_size=4, unique_by=json.dumps))}
    if kind == "const":
        return {"const": draw(scalars)}
    if kind == "$ref":
        return {"$ref": f"#/$defs/{draw(st.sampled_from(refs))}"}
    return {"type": kind}


@st.composite
def subschemas(draw, refs: tuple[str, ...], depth: int) -> dict:
    kind = draw(st.sampled_from(("leaf", "leaf", "object", "array", "anyOf") if depth > 0 else ("leaf",)))
    if kind == "leaf":
        return draw(leaves(refs))
    child = subschemas(refs, depth - 1)
    if kind == "object":
        return draw(objects(child))
    if kind == "array":
        low = draw(st.integers(0, 2))
        return {"type": "array", "items": draw(child), "minItems": low,
                "maxItems": draw(st.integers(max(low, 1), 3))}
    return {"anyOf": draw(st.lists(child, min_size=2, max_size=3))}


@st.composite
def objects(draw, child, refs: tuple[str, ...] = ()) -> dict:
    """Up to four properties, each required or not, none other allowed; one more per name in `refs` that
    references it."""
    keys = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    properties = {k: draw(child) for k in keys}
    for name in refs:
        properties.setdefault(name.lower(), {"$ref": f"#/$defs/{name}"})
    required = [k for k in properties if draw(st.booleans())]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


@st.composite
def json_schemas(draw) -> dict:
    """A bounded, satisfiable schema: an object at the top in nine of ten (as applications send), with
    `$defs` in about a third, referenced from its top level and possibly deeper."""
    defs: dict[str, dict] = {}
    if draw(st.integers(0, 2)) == 0:
        for name in draw(st.lists(st.from_regex(r"[A-Z][a-z]{2,7}", fullmatch=True), min_size=1, max_size=2,
                                  unique=True)):
            defs[name] = draw(subschemas((), 1))
    refs = tuple(sorted(defs))
    body = subschemas(refs, MAX_DEPTH - 1)
    schema = draw(objects(body, refs) if draw(st.integers(0, 9)) else subschemas(refs, MAX_DEPTH))
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def max_chars(schema: dict, defs: dict | None = None) -> int:
    """An upper bound on the length of the JSON text of a value of `schema` (keys and strings as JSON
    escapes them, numbers as NUMBER_CHARS)."""
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        return max_chars(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "const" in schema:
        return len(json.dumps(schema["const"]))
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    if "anyOf" in schema:
        return max(max_chars(s, defs) for s in schema["anyOf"])
    kind = schema["type"]
    if kind == "object":
        return 2 + sum(len(json.dumps(k)) + 2 + max_chars(s, defs) for k, s in schema["properties"].items())
    if kind == "array":
        return 2 + schema["maxItems"] * (max_chars(schema["items"], defs) + 1)
    if kind == "string":
        chars = schema.get("maxLength") or PATTERNS[schema["pattern"]]
        return 2 + 6 * chars  # a control character is escaped as \u00XX
    return {"boolean": 5, "null": 4}.get(kind, NUMBER_CHARS)


bounded_json_schemas = json_schemas().filter(lambda s: max_chars(s) <= MAX_OUTPUT_CHARS)


def draw_schemas(count: int) -> list[dict]:
    """`count` distinct bounded schemas, the same ones every call (for one version of hypothesis)."""
    drawn: dict[str, dict] = {}

    @settings(max_examples=count + count // 2, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(bounded_json_schemas)
    def collect(schema):
        drawn.setdefault(json.dumps(schema, sort_keys=True), schema)

    collect()
    assert len(drawn) >= count, f"hypothesis drew only {len(drawn)} distinct schemas"
    return list(drawn.values())[:count]
