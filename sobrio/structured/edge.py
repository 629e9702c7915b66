"""The grammar gate of the front: a request's schema, regex or grammar compiles here, bounded, before it is queued.

Checking a grammar without the tokenizer (llguidance's `validate_grammar`) let through grammars that only
fail, or take seconds, once compiled against the vocabulary: they reached the engine core and came back
as 500s. Here each one is compiled for real in the API process (against the same tokenizer, with the same
llguidance limits) on a worker thread, within a size bound (the spec's characters) and a time bound (the
`--structured-outputs-compile-timeout`): anything else is a 400 naming the field. A compile past the time
bound cannot be killed (llguidance holds no GIL and bounds its own work, so it finishes alone); the gate
abandons its worker and starts a fresh one. Grammars that passed are remembered (least recently used out),
so a repeated request is not compiled twice here.
"""

import concurrent.futures
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

from sobrio.errors import InvalidRequestError
from sobrio.structured.backend import GrammarCompiler, failure_message
from sobrio.types.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar of more characters than this is refused unread
PASSED_KEPT = 256  # grammars known to compile: their next request skips the compile
EDGE_CACHE = 16  # compiled matchers the gate keeps (the passed set does the rest; the core keeps its own)


class GrammarGate:
    """Compiles each new (kind, spec) once against the tokenizer, within `timeout` seconds; raises a 400."""

    def __init__(self, load_tokenizer: Callable[[], object], timeout: float):
        self.compiler = GrammarCompiler(load_tokenizer, cache_size=EDGE_CACHE)
        self.timeout = timeout
        self._passed: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.refused = 0

    def check(self, params: StructuredOutputsParams, eos_token_ids: Iterable[int]) -> None:
        """Raise InvalidRequestError (param "structured_outputs") unless the grammar compiles in bounds."""
        kind, spec = params.spec
        key = (kind, hashlib.sha256(spec.encode()).hexdigest())
        if key in self._passed:
            self._passed.move_to_end(key)
            return
        if len(spec) > MAX_SPEC_CHARS:
            self._refuse(kind, f"{len(spec)} characters, more than the {MAX_SPEC_CHARS} allowed")
        self.compiler.prepare(eos_token_ids)  # the tokenizer, once: not counted in the grammar's time
        job = self.compiler.submit(params, eos_token_ids)
        try:
            job.future.result(self.timeout)
        except concurrent.futures.TimeoutError:
            self.compiler.restart()
            self._refuse(kind, f"it took longer than {self.timeout:g} s to compile; simplify it")
        except InvalidRequestError:
            self.refused += 1
            raise
        except Exception as exc:  # llguidance failed in a way it has no message for: still the grammar's doing
            logger.warning("a %s grammar failed to compile (%s)", kind, type(exc).__name__)
            self._refuse(kind, f"it cannot be compiled ({type(exc).__name__})")
        self._passed[key] = None
        while len(self._passed) > PASSED_KEPT:
            self._passed.popitem(last=False)

    def _refuse(self, kind: str, why: str) -> None:
        self.refused += 1
        raise InvalidRequestError(failure_message(kind, why), param="structured_outputs")

    def shutdown(self) -> None:
        self.compiler.shutdown()
