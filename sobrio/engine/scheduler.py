"""Continuous batching: each step fills a token budget with decode tokens first, then prompt chunks.

Running requests are served oldest first, one token each if decoding, a chunk if still prefilling.
When the KV cache cannot hold a step, the newest running request is preempted: its blocks are freed and
it goes back to the head of the waiting queue, to be recomputed (mostly from the prefix cache) later.
"""

import time
from collections import deque
from dataclasses import dataclass, field

from sobrio.config import EngineConfig
from sobrio.engine.request import Request, RequestStatus
from sobrio.kv.block_pool import BlockPool
from sobrio.kv.manager import KVCacheManager


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens this step)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int):
        self.config = config
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            assert num_new > 0, "a running request has nothing to compute"
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            out.scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting:
            return  # the common decode step: skip gathering the running requests' pending hashes
        in_prefill = {h for r in self.running for h in self.kv.uncomputed_hashes(r)}
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not req.block_table:
                self.kv.apply_prefix_hits(req)
            if self._next_block_in(req, in_prefill):
                self._reset(req)  # hold it back: its next block will be a cache hit once computed
                deferred.append(self.waiting.popleft())
                if len(deferred) >= self.config.max_num_seqs:
                    break  # bound the scan of a long queue
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(req, num_new):
                self._reset(req)  # give its prefix hits back until it can really start
                break
            self.waiting.popleft()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
            in_prefill.update(self.kv.uncomputed_hashes(req))
        self.waiting.extendleft(reversed(deferred))

    def _next_block_in(self, req: Request, hashes: set[bytes]) -> bool:
        """Whether the first block this request would compute is one a running request is computing now:
        then waiting a step or two turns it into a prefix hit instead of computing it twice."""
        pending = self.kv.uncomputed_hashes(req)
        return bool(pending) and pending[0] in hashes

    def _reset(self, req: Request) -> None:
        self.pool.queries -= req.num_tokens
        self.pool.hits -= req.num_computed_tokens
        self.kv.free(req)
        req.num_computed_tokens = 0

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_after_step(self, out: SchedulerOutput) -> list[Request]:
        """Advance computed counts and hash newly full blocks; return the requests that must sample."""
        sampling = []
        for req, num_new in out.scheduled:
            req.num_computed_tokens += num_new
            self.kv.cache_full_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                sampling.append(req)
        return sampling

    def append_token(self, req: Request, token_id: int) -> None:
        """Add a sampled token and finish the request on EOS, a stop token or its length limit."""
        req.output_token_ids.append(token_id)
        params = req.sampling_params
        if len(req.output_token_ids) >= params.min_tokens:
            if token_id in params.stop_token_ids:
                req.stop_reason = token_id
                return self.finish(req, RequestStatus.FINISHED_STOPPED)
            if token_id in req.eos_token_ids and not params.ignore_eos:
                return self.finish(req, RequestStatus.FINISHED_STOPPED)
        if len(req.output_token_ids) >= req.max_tokens:
            self.finish(req, RequestStatus.FINISHED_LENGTH)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Finish (or abort) a request wherever it is; its blocks go back to the pool."""
        if req.status.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        req.finished_time = time.monotonic()
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req
