"""llguidance: a request's StructuredOutputsParams -> grammar text -> a matcher compiled against the tokenizer.

The front compiles the grammar first, bounded (`edge.GrammarGate`: a bad schema, regex or grammar is a 400
before anything is queued). The engine core compiles it on one worker thread (`GrammarCompiler`): the first
structured request builds the llguidance tokenizer (~0.5 s), each (kind, spec) compiles once and is kept
(least recently used out), and every request gets a fresh copy of the compiled matcher. llguidance bounds
the work itself (its ParserLimits defaults: lexer fuel, Earley items per step, grammar size: a schema built to
explode is "schema too large" in ms); the manager bounds the wall time of a compile on top
(--structured-outputs-compile-timeout).
"""

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from sobrio.errors import InvalidRequestError
from sobrio.types.params import StructuredOutputsParams
from sobrio.types.stats import Histogram

logger = logging.getLogger(__name__)

# Compact JSON (no free whitespace between tokens): a small model cannot loop on newlines inside an object.
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_ERROR_CHARS = 500
# llguidance's default bounds on the work (lexer fuel, Earley items per step, grammar size), without the parser
# state in error messages (they go to the client)
LIMITS = LLParserLimits(verbose_errors=False)
# Compiled grammars kept. Each keeps the lexer states its requests built (llguidance: 1-2 kB each, up to
# max_lexer_states = 250,000), so the cache is memory: 256 of them grew the engine core without end under
# a load of ever new schemas (tool definitions, json_schema); 32 bound it.
CACHE_SIZE = 32


def failure_message(kind: str, why: str) -> str:
    """What a client is told of a grammar that failed: one line, bounded."""
    why = " ".join(why.replace("<non-verbose/>", "").split())  # llguidance's span lines (a caret under the place)
    if len(why) > MAX_ERROR_CHARS:
        why = why[:MAX_ERROR_CHARS] + "..."
    return f"invalid structured output {kind}: {why}"


def _invalid(kind: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(failure_message(kind, why), param="structured_outputs")


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


# seconds; a compile is most often a few ms, a large schema a few hundred
COMPILE_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class CompileJob:
    """One request's compile: its future, and when the worker started it (None while it queues)."""

    future: Future | None = None  # set once submitted
    started: float | None = None

    def running_for(self, now: float) -> float:
        return 0.0 if self.started is None else now - self.started


class GrammarCompiler:
    """Compiles on one worker thread, off the step. A compile that runs too long cannot be killed (llguidance
    holds no GIL while it builds, so it only costs a core): `restart` leaves it to finish alone and starts a
    fresh worker for the rest. The cache and the tokenizer are shared by the workers, under a lock."""

    def __init__(self, load_hf_tokenizer: Callable[[], object], cache_size: int = CACHE_SIZE):
        self._load_hf_tokenizer = load_hf_tokenizer
        self._tokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # started by the first structured request
        self.vocab_size = 0  # the llguidance tokenizer's, once built: the width of its bitmasks (in bits)
        self.hits = self.misses = 0
        self.compile_seconds = Histogram(COMPILE_SECONDS_BUCKETS)  # the compiles themselves (misses)

    def submit(self, params: StructuredOutputsParams, eos_token_ids: Iterable[int]) -> CompileJob:
        """A job whose future gives a fresh matcher for this request (InvalidRequestError if it does not
        compile)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sobrio-grammar")
        job = CompileJob()
        job.future = self._pool.submit(self._run, job, params, sorted(eos_token_ids))
        return job

    def restart(self) -> None:
        """Abandon the worker (stuck in a compile): jobs queued behind it are cancelled, the next submit starts
        a new one."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _run(self, job: CompileJob, params: StructuredOutputsParams, eos_token_ids: list[int]) -> LLMatcher:
        self.prepare(eos_token_ids)  # once per compiler, and not the grammar's time: its timeout starts after
        job.started = time.monotonic()
        return self._compile(params, eos_token_ids)

    def prepare(self, eos_token_ids: Iterable[int]) -> None:
        """Build the llguidance tokenizer now (~0.5 s, seconds on a busy host) if it is not built yet."""
        with self._lock:
            self._llg_tokenizer(sorted(eos_token_ids))

    def _compile(self, params: StructuredOutputsParams, eos_token_ids: list[int]) -> LLMatcher:
        key = params.spec
        with self._lock:
            template = self._lookup(key)
            tokenizer = self._llg_tokenizer(eos_token_ids) if template is None else None
        if template is None:
            template = self._build(tokenizer, params)
            with self._lock:
                self._keep(key, template)
        return template.deep_copy()

    def _lookup(self, key: tuple[str, str]) -> LLMatcher | None:
        template = self._cache.get(key)
        if template is None:
            self.misses += 1
            return None
        self.hits += 1
        self._cache.move_to_end(key)
        return template

    def _build(self, tokenizer: LLTokenizer, params: StructuredOutputsParams) -> LLMatcher:
        """The one slow part (no lock held: an abandoned compile must not block the next worker). The first
        mask is computed here too: llguidance builds its lexer lazily, and a grammar past its limits fails
        there, which is better found here (a 400 before the request runs) than in a step."""
        start = time.monotonic()
        try:
            template = LLMatcher(tokenizer, grammar_text(params), log_level=0, limits=LIMITS)
            if not template.is_error():
                template.compute_bitmask()
        finally:
            self.compile_seconds.observe(time.monotonic() - start)
        if template.is_error():
            raise _invalid(params.spec[0], template.get_error())
        return template

    def _keep(self, key: tuple[str, str], template: LLMatcher) -> None:
        self._cache[key] = template
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _llg_tokenizer(self, eos_token_ids: list[int]) -> LLTokenizer:
        if self._tokenizer is None:
            from llguidance.hf import from_tokenizer

            self._tokenizer = from_tokenizer(self._load_hf_tokenizer(), eos_token=eos_token_ids or None)
            self.vocab_size = self._tokenizer.vocab_size
        return self._tokenizer

    def stats(self) -> dict:
        return {"cache_hits": self.hits, "cache_misses": self.misses,
                "compile_seconds": self.compile_seconds.snapshot()}

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
