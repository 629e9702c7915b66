"""The synchronous engine loop: add requests, step, collect outputs. Single-threaded by design."""

import logging
import time
from dataclasses import dataclass, replace

from sobrio.config import EngineConfig
from sobrio.engine.detokenize import IncrementalDetokenizer
from sobrio.engine.input import InputProcessor
from sobrio.engine.model_runner import ModelRunner
from sobrio.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from sobrio.engine.request import Request, RequestStatus
from sobrio.engine.sampling import build_sampling_metadata
from sobrio.engine.scheduler import Scheduler, SchedulerOutput
from sobrio.errors import EngineOverloadedError, InvalidRequestError
from sobrio.loader.load import load_model_files
from sobrio.sample.params import SamplingParams
from sobrio.sample.sampler import SampledToken, Sampler

logger = logging.getLogger(__name__)


@dataclass
class ProcessedRequest:
    """A tokenized, validated request, ready to queue."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    cache_salt: str | None
    arrival_time: float


class _Sequence:
    """Engine-side state of one output sequence: its request, detokenizer and place in the parent."""

    def __init__(self, req: Request, parent_id: str, index: int, prompt: str | None, detok: IncrementalDetokenizer):
        self.req, self.parent_id, self.index, self.prompt, self.detok = req, parent_id, index, prompt, detok
        self.num_tokens_sent = 0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        files = load_model_files(config.model)
        self.model_name = files.source.name
        self.tokenizer = files.tokenizer
        self.hf_config = files.config
        self.runner = ModelRunner(config, files)
        self.max_model_len = self.runner.max_model_len
        self.scheduler = Scheduler(config, self.runner.num_blocks)
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, self.hf_config.vocab_size)
        self.eos_token_ids = self._eos_token_ids()
        self.sampler = Sampler()
        self.sequences: dict[str, _Sequence] = {}  # child request id -> sequence
        self.children: dict[str, list[str]] = {}  # parent request id -> child request ids
        self.deferred: dict[str, list[Request]] = {}  # first child id -> siblings waiting for its prompt

    def _eos_token_ids(self) -> frozenset[int]:
        ids = self.hf_config.eos_token_id
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ---- requests in ----
    def process_input(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                      cache_salt: str | None = None, arrival_time: float | None = None,
                      prompt_token_ids: list[int] | None = None) -> ProcessedRequest:
        """Tokenize and validate, touching no engine state: safe on any thread, outside the step's lock."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be a SamplingParams")
        self.input_processor.validate_params(params, cache_salt)
        ids = self.input_processor.tokenize(prompt_token_ids if prompt_token_ids is not None else prompt)
        max_tokens = self.input_processor.resolve_max_tokens(len(ids), params)
        text_prompt = prompt if isinstance(prompt, str) else None
        return ProcessedRequest(request_id, text_prompt, ids, params, max_tokens, cache_salt,
                                arrival_time or time.monotonic())

    def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None) -> None:
        """Validate and queue a request (n sequences share its id). Raises InvalidRequestError."""
        self.add_processed(self.process_input(request_id, prompt, params, cache_salt, arrival_time,
                                              prompt_token_ids))

    def add_processed(self, p: ProcessedRequest) -> None:
        """Queue a processed request. Every object is built before any table is touched, so a request that
        fails here leaves nothing behind."""
        if p.request_id in self.children:
            raise InvalidRequestError(f"request id {p.request_id!r} is already in use")
        if len(self.scheduler.waiting) + p.params.n > self.config.max_num_waiting:
            raise EngineOverloadedError("the waiting queue is full; retry later")
        seqs = [self._new_sequence(p, index) for index in range(p.params.n)]
        self.children[p.request_id] = [seq.req.request_id for seq in seqs]
        for seq in seqs:
            self.sequences[seq.req.request_id] = seq
        reqs = [seq.req for seq in seqs]
        self.scheduler.add_request(reqs[0])
        if self.config.enable_prefix_caching and len(reqs) > 1:
            # The siblings wait until the first has computed the prompt, then take its blocks from the
            # prefix cache: n sequences share one copy of the prompt by reference count.
            self.deferred[reqs[0].request_id] = reqs[1:]
        else:
            for req in reqs[1:]:
                self.scheduler.add_request(req)

    def _new_sequence(self, p: ProcessedRequest, index: int) -> "_Sequence":
        params = _child_params(p.params, index)
        child_id = p.request_id if p.params.n == 1 else f"{index}_{p.request_id}"
        req = Request(child_id, list(p.prompt_token_ids), params, p.max_tokens, self.eos_token_ids, p.cache_salt,
                      p.arrival_time)
        detok = IncrementalDetokenizer(self.tokenizer.backend_tokenizer, params)
        return _Sequence(req, p.request_id, index, p.prompt, detok)

    def _release_siblings(self) -> None:
        for first_id, siblings in list(self.deferred.items()):
            first = self.sequences.get(first_id)
            if first is None or first.req.num_computed_tokens >= first.req.num_prompt_tokens - 1:
                for req in siblings:
                    self.scheduler.add_request(req)
                del self.deferred[first_id]

    def abort_request(self, request_id: str) -> None:
        for child_id in self.children.pop(request_id, []):
            self.deferred.pop(child_id, None)
            self.scheduler.abort(child_id)
            self.sequences.pop(child_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.deferred)

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; return an output per sequence that advanced (or failed)."""
        out = self.scheduler.schedule()
        if out.is_empty():
            self._release_siblings()
            return []
        failed: set[str] = set()
        sampled = self._execute_isolating_failures(out, failed)
        outputs = self._fail(failed)
        self.scheduler.update_after_step(out)
        now = time.monotonic()
        for req, token in sampled:
            outputs += self._process_token_or_fail(req, token, now)
        self._release_siblings()
        return outputs

    def _execute(self, out: SchedulerOutput) -> list[tuple[Request, SampledToken]]:
        sampling = [r for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens]
        logits = self.runner.execute(out)
        return list(zip(sampling, self.sampler(logits, build_sampling_metadata(sampling))))

    def _execute_isolating_failures(self, out: SchedulerOutput, failed: set[str]) -> list:
        """Run the step; if it raises, run each request alone, so only the ones that still fail are dropped
        (their parents go to `failed`) and the rest of the batch advances as if nothing happened."""
        try:
            return self._execute(out)
        except Exception as exc:
            logger.warning("engine step failed (%s); retrying its %d requests one at a time",
                           type(exc).__name__, len(out.scheduled))
        sampled = []
        for req, num_new in out.scheduled:
            try:
                sampled += self._execute(SchedulerOutput([(req, num_new)]))
            except Exception as exc:
                logger.warning("request %s failed in the engine step (%s)", req.request_id, type(exc).__name__)
                failed.add(self.sequences[req.request_id].parent_id)
        out.scheduled = [(r, n) for r, n in out.scheduled if self.sequences[r.request_id].parent_id not in failed]
        return [(r, t) for r, t in sampled if self.sequences[r.request_id].parent_id not in failed]

    def _process_token_or_fail(self, req: Request, token: SampledToken, now: float) -> list[RequestOutput]:
        seq = self.sequences.get(req.request_id)
        if seq is None:  # a sibling failed earlier in this step: the whole parent is gone
            return []
        try:
            return [self._process_token(req, token, now)]
        except Exception as exc:
            logger.warning("request %s failed after sampling (%s)", req.request_id, type(exc).__name__)
            return self._fail({seq.parent_id})

    def _fail(self, parent_ids: set[str]) -> list[RequestOutput]:
        """Finish every sequence of these requests with finish_reason "error"; their blocks go back."""
        outputs = []
        for parent_id in parent_ids:
            for child_id in self.children.get(parent_id, []):
                seq = self.sequences.get(child_id)
                self.deferred.pop(child_id, None)
                if seq is None:
                    continue
                self.scheduler.finish(seq.req, RequestStatus.FINISHED_ERROR)
                outputs.append(self._make_output(seq))
                self._forget(seq)
        return outputs

    def _process_token(self, req: Request, token: SampledToken, now: float) -> RequestOutput:
        seq = self.sequences[req.request_id]
        if req.first_token_time is None:
            req.first_token_time = now
        self.scheduler.append_token(req, token.token_id)
        if token.logprob is not None:
            req.output_logprobs.append(self._logprob_dict(token))
        stop = seq.detok.add(token.token_id)
        if stop is not None and not req.status.finished:
            req.stop_reason = stop
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        output = self._make_output(seq)
        if req.status.finished:
            self._forget(seq)
        return output

    def _logprob_dict(self, token: SampledToken) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        entries = {tid: Logprob(lp, rank + 1, decode([tid])) for rank, (tid, lp) in enumerate(token.top_logprobs)}
        entries[token.token_id] = Logprob(token.logprob, token.rank, decode([token.token_id]))
        return entries

    def _make_output(self, seq: _Sequence) -> RequestOutput:
        req = seq.req
        finished = req.status.finished
        delta_ids = req.output_token_ids[seq.num_tokens_sent:]
        seq.num_tokens_sent = len(req.output_token_ids)
        logprobs = req.output_logprobs if req.sampling_params.logprobs is not None else None
        completion = CompletionOutput(seq.index, seq.detok.text, list(req.output_token_ids), req.finish_reason,
                                      req.stop_reason, logprobs,
                                      sum(d[t].logprob for d, t in zip(logprobs, req.output_token_ids))
                                      if logprobs else None)
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                 req.finished_time, req.num_preemptions)
        return RequestOutput(seq.parent_id, seq.prompt, req.prompt_token_ids, [completion], finished, metrics,
                             req.num_cached_tokens, seq.detok.delta(finished), delta_ids)

    def _forget(self, seq: _Sequence) -> None:
        self.sequences.pop(seq.req.request_id, None)
        siblings = self.children.get(seq.parent_id, [])
        if all(c not in self.sequences for c in siblings):
            self.children.pop(seq.parent_id, None)

    def table_sizes(self) -> dict[str, int]:
        """Entries of every per-request table: all zero when nothing is in flight (a leak shows here)."""
        sched = self.scheduler
        return {"engine_sequences": len(self.sequences), "engine_children": len(self.children),
                "engine_deferred": len(self.deferred), "scheduler_requests": len(sched.requests),
                "scheduler_waiting": len(sched.waiting), "scheduler_running": len(sched.running)}

    def stats(self) -> dict:
        pool = self.scheduler.pool
        return {
            "tables": self.table_sizes(),
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": pool.usage(),
            "prefix_cache_queries": pool.queries,
            "prefix_cache_hits": pool.hits,
            "num_preemptions": self.scheduler.num_preemptions,
        }


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each of n sequences gets its own seed (seed + index), so seeded n > 1 still differs per sequence."""
    if params.n == 1:
        return params
    return replace(params, n=1, seed=params.child_seed(index))
