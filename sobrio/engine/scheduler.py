"""Continuous batching: each step fills a token budget with decode tokens first, then prompt chunks.

Running requests are served oldest first, one token each if decoding (a few when structured output forced
tokens after the sampled one), a chunk if still prefilling.
When the KV cache cannot hold a step, the newest running request is preempted: its blocks are freed and
it goes back to the head of the waiting queue, to be recomputed (mostly from the prefix cache) later.
A step that carries decodes also obeys `PrefillSlots`: its prompt work is bounded, so a long prompt does
not stall the next token of every running request.
Under `--scheduling-policy priority` the waiting queue is ordered by (priority, arrival) instead of
arrival alone, and the preempted request is the running one of lowest priority (latest arrival on a tie).
"""

import bisect
import sys
import time
from collections import deque
from dataclasses import dataclass

from sobrio.config import SchedulerConfig, SobrioConfig
from sobrio.kv.block_pool import BlockPool
from sobrio.kv.manager import KVCacheManager
from sobrio.types.request import Request, RequestStatus
from sobrio.types.scheduler_output import SchedulerOutput


def is_decode(req: Request) -> bool:
    """Past the first output, with only the last step's tokens left: the step feeds back the token sampled
    last step and those its grammar forced after it (fast-forward), all in one query, outside the prefill
    slots. A preempted request recomputes everything, a prompt's worth: not a decode."""
    return bool(req.output_token_ids) and req.num_tokens - req.num_computed_tokens <= 1 + req.num_forced_tokens


@dataclass
class PrefillSlots:
    """The prompt work a step that carries decodes may still take (vLLM's partial-prefill policy, plus
    Sarathi-Serve's token budget).

    Every decode waits for its whole step, so each prompt token in that step delays the next token of
    every running request. Such a step gives a prompt at most `threshold` tokens, gives tokens to
    at most `prefills` prompts, and at most `long` of those have more than `threshold` tokens left (so a
    short prompt can start beside a long one); all its prompts together get at most `tokens`.
    A step without decodes delays no one's next token: it only obeys the token budget.
    """

    threshold: int  # 0: no cap, and no prompt is long
    prefills: int
    long: int
    tokens: int

    @classmethod
    def for_step(cls, config: SchedulerConfig, carries_decodes: bool) -> "PrefillSlots":
        if not carries_decodes:
            return cls(0, sys.maxsize, sys.maxsize, sys.maxsize)
        return cls(config.long_prefill_token_threshold, config.max_num_partial_prefills,
                   config.max_long_partial_prefills, config.max_prompt_tokens_with_decodes or sys.maxsize)

    def is_long(self, remaining: int) -> bool:
        return 0 < self.threshold < remaining

    def grant(self, remaining: int, num_new: int) -> int:
        """Tokens a prompt with `remaining` left may compute now, of `num_new` that fit the budget; 0: none."""
        if self.prefills == 0 or (self.is_long(remaining) and self.long == 0):
            return 0
        num_new = min(num_new, self.tokens)
        return min(num_new, self.threshold) if self.threshold else num_new

    def take(self, remaining: int, num_new: int) -> None:
        """A prompt got its chunk: one slot fewer (and one long slot fewer if it is long)."""
        assert self.prefills > 0 and not (self.is_long(remaining) and self.long == 0) and num_new <= self.tokens
        self.prefills -= 1
        self.long -= self.is_long(remaining)
        self.tokens -= num_new


class Scheduler:
    def __init__(self, config: SobrioConfig, num_blocks: int, sliding_window: int | None = None):
        """`sliding_window`: the widest window when every layer has one, so blocks behind it are freed as
        requests advance (None: keep every block)."""
        self.config = config
        self.scheduler_config = config.scheduler_config  # read every step
        self.pool = BlockPool(num_blocks, config.cache_config.block_size, config.cache_config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, sliding_window)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.by_priority = self.scheduler_config.scheduling_policy == "priority"

    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        if self.by_priority:
            self._insert_waiting(req)
        else:
            self.waiting.append(req)

    def _insert_waiting(self, req: Request) -> None:
        """Priority policy: keep the waiting queue sorted by (priority, arrival)."""
        self.waiting.insert(bisect.bisect_right(self.waiting, req.sort_key, key=lambda r: r.sort_key), req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        slots = PrefillSlots.for_step(self.scheduler_config, any(map(is_decode, self.running)))
        budget = self._schedule_running(out, self.scheduler_config.max_num_batched_tokens, slots)
        if not out.preempted:
            self._schedule_waiting(out, budget, slots)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, slots: PrefillSlots) -> int:
        """Oldest first. A prompt past the step's prefill slots is skipped, keeping its blocks: only older
        prompts hold the slots, so it goes on as soon as they finish."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            assert remaining > 0, "a running request has nothing to compute"
            prompt = not is_decode(req)
            num_new = slots.grant(remaining, min(remaining, budget)) if prompt else self._with_drafts(req, budget)
            if num_new == 0:
                i += 1
                continue
            self.kv.free_outside_window(req)
            while not self.kv.allocate_slots(req, num_new):
                if req.spec_token_ids:  # the drafts go before anyone is preempted
                    num_new -= len(req.spec_token_ids)
                    req.spec_token_ids.clear()
                    continue
                victim = self._pick_victim(i)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            if prompt:
                slots.take(remaining, num_new)
            out.scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        return budget

    @staticmethod
    def _with_drafts(req: Request, budget: int) -> int:
        """A decode's tokens this step: the ones left to compute and its drafts, those past the budget dropped."""
        remaining = req.num_tokens - req.num_computed_tokens
        num_new = min(remaining + len(req.spec_token_ids), budget)
        del req.spec_token_ids[max(0, num_new - remaining):]
        return num_new

    def _pick_victim(self, first: int) -> Request:
        """The running request to preempt, among those not yet scheduled this step (index >= first): the
        newest (fcfs), or the lowest priority, newest on a tie (priority)."""
        if not self.by_priority:
            return self.running.pop()
        index = max(range(first, len(self.running)), key=lambda j: self.running[j].sort_key)
        return self.running.pop(index)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, slots: PrefillSlots) -> None:
        """Admit prompts in order. One held back (its next block is being computed, or it is long and the
        long slots are taken) lets the ones behind it pass; it keeps its place at the head."""
        if not self.waiting:
            return  # the common decode step: skip gathering the running requests' pending hashes
        in_prefill = {h for r in self.running for h in self.kv.uncomputed_hashes(r)}
        deferred: list[Request] = []
        max_num_seqs = self.scheduler_config.max_num_seqs
        while (self.waiting and budget > 0 and slots.prefills > 0 and slots.tokens > 0
               and len(self.running) < max_num_seqs):
            req = self.waiting[0]
            if self._adapter_waits(req):  # --max-loras adapters run already: it waits for one to finish
                deferred.append(self.waiting.popleft())
                if len(deferred) >= max_num_seqs:
                    break
                continue
            if not req.block_table and not req.wants_prompt_logprobs:
                self.kv.apply_prefix_hits(req)
            remaining = req.num_tokens - req.num_computed_tokens
            num_new = slots.grant(remaining, min(remaining, budget))
            if num_new == 0 or self._next_block_in(req, in_prefill) or self.kv.loading(req):
                self._reset(req)  # hold it back; with a pending block, that block will be a cache hit
                deferred.append(self.waiting.popleft())
                if len(deferred) >= max_num_seqs:
                    break  # bound the scan of a long queue
                continue
            if not self.kv.allocate_slots(req, num_new):
                self._reset(req)  # give its prefix hits back until it can really start
                break
            self.waiting.popleft()
            slots.take(remaining, num_new)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
                # prompt tokens only: a repeated structured request's forced output tokens may hit the cache too
                req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
            in_prefill.update(self.kv.uncomputed_hashes(req))
        self.waiting.extendleft(reversed(deferred))

    def _adapter_waits(self, req: Request) -> bool:
        """Whether admitting it would put more LoRA adapters than --max-loras in the running batch."""
        adapter = req.sampling_params.lora_request
        if adapter is None:
            return False
        active = {r.sampling_params.lora_request for r in self.running} - {None}
        return adapter not in active and len(active) >= self.config.lora_config.max_loras

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
        req.spec_token_ids.clear()
        req.num_computed_tokens = req.num_draft_kv = 0  # the blocks of both KV caches are gone
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            self._insert_waiting(req)
        else:
            self.waiting.appendleft(req)

    def update_after_step(self, out: SchedulerOutput) -> list[Request]:
        """Advance computed counts and hash newly full blocks; return the requests that must sample. Drafts
        count as computed only once accepted (`accept_drafts`)."""
        sampling = []
        for req, num_new in out.scheduled:
            req.num_computed_tokens += num_new - len(req.spec_token_ids)
            self.kv.cache_full_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                sampling.append(req)
        return sampling

    def accept_drafts(self, req: Request, num_accepted: int) -> None:
        """The step computed these drafts' KV, and they are now output tokens: count them computed and hash the
        blocks they filled. The KV of rejected drafts stays in its slots, to be overwritten."""
        req.spec_token_ids = []
        if not req.status.finished:
            req.num_computed_tokens += num_accepted
            assert req.num_computed_tokens < req.num_tokens, "the last output token is computed next step"
            self.kv.cache_full_blocks(req)

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
        req.spec_token_ids = []
        req.status = status
        req.finished_time = time.monotonic()
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req
