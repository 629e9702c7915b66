"""Per-request grammar state in the engine core: compile, wait, mask, advance, fast-forward, free.

A structured request is not handed to the scheduler until its grammar has compiled (`submit`, then `ready`
at the start of each step): it waits beside the scheduler, never inside a step. A compile that runs past the
timeout fails its request (a 400 at the front), and the requests queued behind it move to a fresh worker.
Each step, the rows that sample and have a matcher get one int32 bitmask row each (`[rows, ceil(vocab/32)]`,
filled by llguidance's threads), handed to the sampler as `SamplingMetadata.allowed_tokens`. A matcher advances only
on a token the core appends (`accept`), so a retried step or a preempted request that recomputes its tokens
never advances it twice; it is freed when its request finishes or is aborted.

Fast-forward: `forced_token` computes a request's next mask right after its token is accepted; when that mask
allows one token only, the core appends it without sampling (token-by-token decoding could pick nothing else).
Otherwise the mask is kept for the step that samples, so it is computed once either way.
"""

import concurrent.futures
import logging
import time

import torch
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par  # not .torch: no torch.compile

from sobrio.config.structured import StructuredOutputsConfig
from sobrio.errors import InvalidRequestError
from sobrio.sample.metadata import TokenBitmask
from sobrio.structured.backend import CompileJob, GrammarCompiler, failure_message
from sobrio.types.request import Request

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT = StructuredOutputsConfig.structured_outputs_compile_timeout  # the flag's default


def sole_token(row: torch.Tensor) -> int | None:
    """The token an int32 bitmask row allows if it allows exactly one, else None."""
    words = row.nonzero()
    if words.numel() != 1:
        return None
    w = int(words[0])
    bits = int(row[w]) & 0xFFFFFFFF
    if bits & (bits - 1):
        return None
    return 32 * w + bits.bit_length() - 1


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, compile_timeout: float = DEFAULT_COMPILE_TIMEOUT):
        self.compiler = compiler
        self.compile_timeout = compile_timeout
        self.pending: dict[str, tuple[Request, object, CompileJob]] = {}  # request id -> (request, tag, compile)
        self.matchers: dict[str, LLMatcher] = {}
        # request id -> its next-token bitmask row, computed ahead (the fast-forward check); stale once it advances
        self.next_masks: dict[str, torch.Tensor] = {}
        self._executor: LLExecutor | None = None
        self.num_requests = self.num_forced_tokens = 0  # /metrics

    # ---- compile ----
    def submit(self, req: Request, tag: object = None) -> None:
        """Start compiling the request's grammar; `ready` hands the request (and `tag`) back once done."""
        params = req.sampling_params.structured_outputs
        self.pending[req.request_id] = (req, tag, self.compiler.submit(params, req.eos_token_ids))
        self.num_requests += 1

    def has_pending(self) -> bool:
        return bool(self.pending)

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes or `timeout` passes (a core with nothing else to do)."""
        concurrent.futures.wait([job.future for _, _, job in self.pending.values()], timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def ready(self) -> tuple[list[tuple[Request, object]], list[tuple[Request, str | None]]]:
        """The requests whose grammar compiled (with their tags, in arrival order), and those that failed, each
        with what its client is told (None: the engine's fault, not the request's)."""
        failed = self._expire(time.monotonic())
        done = []
        for request_id, (req, tag, job) in list(self.pending.items()):
            if not job.future.done():
                continue
            del self.pending[request_id]
            exc = job.future.exception()
            if exc is not None:
                logger.warning("request %s: its grammar did not compile (%s)", request_id, type(exc).__name__)
                why = str(exc) if isinstance(exc, InvalidRequestError) else \
                    failure_message(req.sampling_params.structured_outputs.spec[0], type(exc).__name__)
                failed.append((req, why))  # the grammar's doing either way: its client gets a 400
            else:
                self.matchers[request_id] = job.future.result()
                done.append((req, tag))
        return done, failed

    def _expire(self, now: float) -> list[tuple[Request, str | None]]:
        """Fail the compiles running past the timeout; the worker stuck in one is left to it, and the jobs
        queued behind it go to a fresh one."""
        late = [rid for rid, (_, _, job) in self.pending.items()
                if not job.future.done() and job.running_for(now) > self.compile_timeout]
        if not late:
            return []
        failed = []
        for request_id in late:
            req, _, _ = self.pending.pop(request_id)
            logger.warning("request %s: its grammar took over %.3g s to compile", request_id, self.compile_timeout)
            failed.append((req, f"the structured output grammar took longer than {self.compile_timeout:g} s to "
                                "compile; simplify the schema, regex or grammar"))
        self.compiler.restart()
        for request_id, (req, tag, job) in self.pending.items():
            if job.future.cancelled():
                self.pending[request_id] = (req, tag, self.compiler.submit(req.sampling_params.structured_outputs,
                                                                           req.eos_token_ids))
        return failed

    # ---- each step ----
    def allowed_tokens(self, reqs: list[Request]) -> TokenBitmask | None:
        """The constrained rows of `reqs` and their bitmasks; None when no row is constrained. Bits past the
        tokenizer's vocabulary are never set, so the model's padding ids are never allowed."""
        rows = [(i, r.request_id) for i, r in enumerate(reqs) if r.request_id in self.matchers]
        if not rows:
            return None
        bitmask = self._bitmask([request_id for _, request_id in rows])
        return TokenBitmask(torch.tensor([i for i, _ in rows]), bitmask)

    def _bitmask(self, request_ids: list[str]) -> torch.Tensor:
        """int32 [len(request_ids), W]: the masks computed ahead, and the others filled in parallel."""
        bitmask = self._allow_all(len(request_ids))
        todo = []
        for k, request_id in enumerate(request_ids):
            ahead = self.next_masks.get(request_id)
            if ahead is None:
                todo.append((self.matchers[request_id], k))
            else:
                bitmask[k] = ahead
        if todo:
            if self._executor is None:
                self._executor = LLExecutor()
            fill_next_token_bitmask_par(self._executor, todo, bitmask.numpy())  # its memory
        return bitmask

    def _allow_all(self, rows: int) -> torch.Tensor:
        """int32 bitmask rows of the tokenizer's width, every bit set (llguidance fills them in)."""
        return torch.full((rows, (self.compiler.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def forced_token(self, req: Request) -> int | None:
        """The one token the grammar allows next, if it allows exactly one (None otherwise, or when complete).
        The mask computed for this is kept for the step that samples."""
        matcher = self.matchers.get(req.request_id)
        if matcher is None or matcher.is_stopped():
            return None
        row = self.next_masks.get(req.request_id)
        if row is None:
            row = self._allow_all(1)
            fill_next_token_bitmask(matcher, row.numpy())
            row = self.next_masks[req.request_id] = row[0]
        return None if matcher.is_error() else sole_token(row)

    def accept(self, req: Request, token_id: int) -> str | None:
        """Advance the request's matcher by an appended token. "stop": the grammar is complete (only EOS could
        follow); "error": the grammar failed, `req.error` says why (one of llguidance's limits, or a token its
        mask allowed and it then refused: the request's grammar either way, a 400); None: go on."""
        matcher = self.matchers.get(req.request_id)
        if matcher is None:
            return None
        self.next_masks.pop(req.request_id, None)
        if matcher.is_error():  # a mask computation met a limit
            req.error = failure_message(req.sampling_params.structured_outputs.spec[0], matcher.get_error())
            return "error"
        if not matcher.consume_token(token_id):
            logger.warning("request %s: a sampled token broke its grammar", req.request_id)
            # llguidance refused a token its own mask allowed: seen on pathological grammars (a regex
            # a{1000}{1000}); the grammar's doing, so its client gets a 400, not an engine failure
            req.error = failure_message(req.sampling_params.structured_outputs.spec[0],
                                        "the grammar refused a token it had allowed; it is beyond what llguidance "
                                        "handles reliably, simplify it")
            return "error"
        return "stop" if matcher.is_stopped() else None

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self.matchers

    def free(self, request_id: str) -> None:
        entry = self.pending.pop(request_id, None)
        if entry is not None:
            entry[2].future.cancel()
        self.matchers.pop(request_id, None)
        self.next_masks.pop(request_id, None)

    def table_sizes(self) -> dict[str, int]:
        assert self.next_masks.keys() <= self.matchers.keys(), "a mask computed ahead outlived its matcher"
        return {"structured_pending": len(self.pending), "structured_matchers": len(self.matchers)}

    def stats(self) -> dict:
        return {**self.compiler.stats(), "requests": self.num_requests, "forced_tokens": self.num_forced_tokens}

    def shutdown(self) -> None:
        self.compiler.shutdown()
