"""Per-request grammar state in the engine core: compile, wait, mask, advance, free.

A structured request is not handed to the scheduler until its grammar has compiled (`submit`, then `ready`
at the start of each step): it waits beside the scheduler, never inside a step. Each step, the rows that
sample and have a matcher get one int32 bitmask row each (`[rows, ceil(vocab/32)]`, filled by llguidance's
threads), unpacked into `SamplingMetadata.allowed_token_mask`. A matcher advances only on a token the core
appends (`accept`), so a retried step or a preempted request that recomputes its tokens never advances it
twice; it is freed when its request finishes or is aborted.
"""

import concurrent.futures
import logging
from concurrent.futures import Future

import torch
from llguidance import LLExecutor, LLMatcher
from llguidance.torch import fill_next_token_bitmask_par

from sobrio.engine.request import Request
from sobrio.structured.backend import GrammarCompiler

logger = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """int32 [R, W] (bit j of word w: token 32w + j) -> bool [R, width]; tokens past 32W are not allowed."""
    bits = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().reshape(bitmask.shape[0], -1)
    if bits.shape[1] >= width:
        return bits[:, :width]
    return torch.cat([bits, bits.new_zeros(bits.shape[0], width - bits.shape[1])], dim=1)


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.pending: dict[str, tuple[Request, object, Future]] = {}  # request id -> (request, tag, compile)
        self.matchers: dict[str, LLMatcher] = {}
        self._executor: LLExecutor | None = None

    # ---- compile ----
    def submit(self, req: Request, tag: object = None) -> None:
        """Start compiling the request's grammar; `ready` hands the request (and `tag`) back once done."""
        params = req.sampling_params.structured_outputs
        self.pending[req.request_id] = (req, tag, self.compiler.submit(params, req.eos_token_ids))

    def has_pending(self) -> bool:
        return bool(self.pending)

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes or `timeout` passes (a core with nothing else to do)."""
        concurrent.futures.wait([f for _, _, f in self.pending.values()], timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def ready(self) -> tuple[list[tuple[Request, object]], list[Request]]:
        """The requests whose grammar compiled (with their tags, in arrival order), and those that failed."""
        done, failed = [], []
        for request_id, (req, tag, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[request_id]
            exc = future.exception()
            if exc is not None:
                logger.warning("request %s: its grammar did not compile (%s)", request_id, type(exc).__name__)
                failed.append(req)
            else:
                self.matchers[request_id] = future.result()
                done.append((req, tag))
        return done, failed

    # ---- each step ----
    def allowed_token_mask(self, reqs: list[Request], vocab_size: int) -> torch.Tensor | None:
        """bool [len(reqs), vocab_size]: each constrained row's allowed tokens; other rows all True. None when
        no row is constrained."""
        rows = [(i, self.matchers[r.request_id]) for i, r in enumerate(reqs) if r.request_id in self.matchers]
        if not rows:
            return None
        if self._executor is None:
            self._executor = LLExecutor()
        bitmask = torch.full((len(rows), (self.compiler.vocab_size + 31) // 32), -1, dtype=torch.int32)
        fill_next_token_bitmask_par(self._executor, [(m, k) for k, (_, m) in enumerate(rows)], bitmask)
        mask = torch.ones(len(reqs), vocab_size, dtype=torch.bool)
        allowed = unpack_bitmask(bitmask, min(vocab_size, self.compiler.vocab_size))
        index = torch.tensor([i for i, _ in rows])
        mask[index, :allowed.shape[1]] = allowed
        mask[index, allowed.shape[1]:] = False  # the model's vocabulary past the tokenizer's
        return mask

    def accept(self, req: Request, token_id: int) -> str | None:
        """Advance the request's matcher by an appended token. "stop": the grammar is complete (only EOS could
        follow); "error": the token broke the grammar (it cannot, unless the mask was bypassed); None: go on."""
        matcher = self.matchers.get(req.request_id)
        if matcher is None:
            return None
        if not matcher.consume_token(token_id):
            logger.warning("request %s: a sampled token broke its grammar", req.request_id)
            return "error"
        return "stop" if matcher.is_stopped() else None

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self.matchers

    def free(self, request_id: str) -> None:
        entry = self.pending.pop(request_id, None)
        if entry is not None:
            entry[2].cancel()
        self.matchers.pop(request_id, None)

    def table_sizes(self) -> dict[str, int]:
        return {"structured_pending": len(self.pending), "structured_matchers": len(self.matchers)}

    def shutdown(self) -> None:
        self.compiler.shutdown()
