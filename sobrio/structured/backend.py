"""llguidance: a request's StructuredOutputsParams -> grammar text -> a matcher compiled against the tokenizer.

The front checks the grammar without a tokenizer (`validate`: a bad schema, regex or grammar is a 400 before
anything is queued). The engine core compiles it on one worker thread (`GrammarCompiler`): the first
structured request builds the llguidance tokenizer (~0.5 s), each (kind, spec) compiles once and is kept
(least recently used out), and every request gets a fresh copy of the compiled matcher.
"""

import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from llguidance import LLMatcher, LLTokenizer

from sobrio.errors import InvalidRequestError
from sobrio.sample.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compact JSON (no free whitespace between tokens): a small model cannot loop on newlines inside an object.
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_ERROR_CHARS = 500
CACHE_SIZE = 256


def _invalid(kind: str, why: str) -> InvalidRequestError:
    why = " ".join(why.split())  # llguidance's messages span lines (a caret under the place)
    if len(why) > MAX_ERROR_CHARS:
        why = why[:MAX_ERROR_CHARS] + "..."
    return InvalidRequestError(f"invalid structured output {kind}: {why}", param="structured_outputs")


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for one request's constraint (not yet checked)."""
    kind, spec = params.spec
    try:
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec)
        if kind == "choice":  # Lark string literals are JSON strings
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        return LLMatcher.grammar_from_lark(_as_lark(spec))
    except ValueError as exc:  # not JSON, not an object
        raise _invalid(kind, str(exc)) from None


def _as_lark(grammar: str) -> str:
    """vLLM takes Lark or GBNF (llama.cpp's EBNF, `root ::= ...`); llguidance takes Lark."""
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    try:
        return any_to_lark(grammar)
    except GbnfToLarkError as exc:
        raise _invalid("grammar", str(exc)) from None


def validate(params: StructuredOutputsParams) -> None:
    """Raise InvalidRequestError naming the problem if the schema, regex or grammar cannot be compiled."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar_text(params), None)
    if is_error:
        raise _invalid(params.spec[0], messages[0] if messages else "cannot be compiled")


class GrammarCompiler:
    """Compiles on one worker thread, off the step; the cache and the tokenizer live on that thread only."""

    def __init__(self, load_hf_tokenizer: Callable[[], object], cache_size: int = CACHE_SIZE):
        self._load_hf_tokenizer = load_hf_tokenizer
        self._tokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._pool: ThreadPoolExecutor | None = None  # started by the first structured request
        self.vocab_size = 0  # the llguidance tokenizer's, once built: the width of its bitmasks (in bits)
        self.hits = self.misses = 0

    def submit(self, params: StructuredOutputsParams, eos_token_ids: Iterable[int]) -> Future:
        """A future of a fresh matcher for this request (InvalidRequestError if it does not compile)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sobrio-grammar")
        return self._pool.submit(self._compile, params, sorted(eos_token_ids))

    def _compile(self, params: StructuredOutputsParams, eos_token_ids: list[int]) -> LLMatcher:
        key = params.spec
        template = self._cache.get(key)
        if template is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return template.deep_copy()
        template = LLMatcher(self._llg_tokenizer(eos_token_ids), grammar_text(params), log_level=0)
        if template.is_error():
            raise _invalid(key[0], template.get_error())
        self.misses += 1
        self._cache[key] = template
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return template.deep_copy()

    def _llg_tokenizer(self, eos_token_ids: list[int]) -> LLTokenizer:
        if self._tokenizer is None:
            from llguidance.hf import from_tokenizer

            self._tokenizer = from_tokenizer(self._load_hf_tokenizer(), eos_token=eos_token_ids or None)
            self.vocab_size = self._tokenizer.vocab_size
        return self._tokenizer

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
