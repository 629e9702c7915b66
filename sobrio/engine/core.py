"""EngineCore: scheduler + executor + sampler and nothing else.

Plain, picklable requests come in (token ids, sampling parameters, salt, arrival time); each step hands
back plain outputs (request id, new token ids, their logprobs, finish reason, cached prompt tokens).
No text, no tokenizer and no live `Request` crosses it, so the same core runs in-process or in a
process of its own behind the same client protocol.
"""

import logging
import time
from dataclasses import dataclass, field

import torch

from sobrio.config import SobrioConfig
from sobrio.distributed.kv_connector import open_connector
from sobrio.engine.executor import Executor, ExecutorDeadError
from sobrio.engine.sampling import build_sampling_metadata
from sobrio.engine.scheduler import Scheduler
from sobrio.engine.stats import StepTokenCounts
from sobrio.engine.step_energy import StepFlops, open_meter, split_by_flops
from sobrio.engine.tp_executor import TensorParallelExecutor
from sobrio.kv.offload import BlockCodec, open_offload
from sobrio.loader.load import LoadedModelFiles, load_tokenizer
from sobrio.models.registry import kv_window
from sobrio.sample.rejection import verify
from sobrio.sample.sampler import SampledToken, Sampler
from sobrio.speculative.speculator import ModelAccess, Speculator
from sobrio.structured.backend import GrammarCompiler
from sobrio.structured.manager import StructuredOutputManager
from sobrio.types.params import SamplingParams
from sobrio.types.request import Request, RequestStatus
from sobrio.types.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against the context by the front
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    arrival_time: float = 0.0
    priority: int = 0
    kv_offload: bool | None = None  # may its KV blocks be offloaded (a tenant's policy); None: the server's
    # n > 1: start once this sibling has computed the shared prompt, then take its blocks from the cache
    after_prompt_of: str | None = None
    # disaggregated serving: {"export": True} on the prefill core; on the decode core, the prefill's
    # kv_transfer_params (where its blocks are), imported before the request is scheduled
    kv_transfer: dict | None = None


@dataclass
class TokenLogprob:
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that finished it
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # prompt_logprobs: once, with the first token; entry k is for prompt token k + 1 (token 0 has none)
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # "error" by the request's own fault (its grammar): what its client is told (400)
    energy_j: float = 0.0  # the request's so far (engine/step_energy.py)
    energy_source: str | None = None
    kv_transfer_params: dict | None = None  # a finished prefill's exported blocks (distributed/kv_connector.py)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Deferred:
    """Siblings waiting for a request to compute their shared prompt."""

    first: Request
    siblings: list[Request] = field(default_factory=list)


class EngineCore:
    def __init__(self, config: SobrioConfig, files: LoadedModelFiles):
        self.config = config
        tp = config.parallel_config.tensor_parallel_size > 1
        self.executor = TensorParallelExecutor(config, files) if tp else Executor(config, files)
        self.max_model_len = self.executor.max_model_len
        self.scheduler = Scheduler(config, self.executor.num_blocks, self._freeable_window(config))
        self.sampler = Sampler()
        self.step_tokens = StepTokenCounts()  # /metrics: iteration_tokens_total
        self.meter, self.flops = open_meter(), StepFlops(self.executor.runner.hf_config)  # engine/step_energy.py
        self.draft_energy = 0.0
        self.deferred: dict[str, _Deferred] = {}  # first request id -> siblings not yet scheduled
        runner, model = self.executor.runner, config.model_config
        self.offload = open_offload(config.cache_config, f"{model.model}|{model.quantization}",
                                    [runner.kv_cache, runner.draft_kv_cache], self.scheduler.kv)  # or None
        self.kv_connector = open_connector(config)  # disaggregated prefill/decode, or None
        self.block_codec = BlockCodec([c for c in (runner.kv_cache, runner.draft_kv_cache) if c is not None]) \
            if self.kv_connector is not None else None
        # structured output: grammars compile on a worker thread (the tokenizer is read at the first one)
        structured = config.structured_outputs_config
        self.structured = StructuredOutputManager(GrammarCompiler(lambda: load_tokenizer(files, config.model_config)),
                                                  structured.structured_outputs_compile_timeout)
        self.fast_forward = structured.structured_outputs_fast_forward
        speculative = config.speculative_config
        self.speculator = None
        if speculative.enabled:
            access = ModelAccess(self.executor.runner.hf_config.vocab_size, self.executor.num_layers,
                                 self.executor.draft, self.scheduler.kv.allocate_slots,
                                 self.executor.draft_eagle)
            self.speculator = Speculator(speculative, self.max_model_len, access)

    def _freeable_window(self, config: SobrioConfig) -> int | None:
        """The window behind which KV blocks may be freed during decode: the model's, when every layer has one
        and no second cache shares the block tables (a draft model, an EAGLE head) and no prompt's blocks are
        exported whole (disaggregated prefill)."""
        runner = self.executor.runner
        if getattr(runner, "draft_kv_cache", None) is not None or getattr(runner, "eagle", None) is not None \
                or config.kv_transfer_config.enabled:
            return None
        return kv_window(runner.hf_config)

    # ---- requests in ----
    def add_request(self, creq: EngineCoreRequest) -> None:
        req = Request(creq.request_id, list(creq.prompt_token_ids), creq.sampling_params, creq.max_tokens,
                      creq.eos_token_ids, creq.cache_salt, creq.arrival_time or time.monotonic(),
                      priority=creq.priority)
        # tiers configured: a request without a policy of its own (no tenant) uses them
        req.kv_offload = self.offload is not None and creq.kv_offload is not False
        if creq.kv_transfer is not None:
            req.kv_export = bool(creq.kv_transfer.get("export"))
            if not req.kv_export:
                self._import_blocks(creq.kv_transfer, creq.cache_salt)
        if creq.sampling_params.structured_outputs is not None:  # scheduled once its grammar has compiled
            self.structured.submit(req, creq.after_prompt_of)
            return
        self._admit(req, creq.after_prompt_of)

    def _import_blocks(self, params: dict, salt: str | None) -> None:
        """A prefill core's exported blocks, into the RAM tier: the prefix lookup then restores them."""
        assert self.kv_connector is not None and self.offload is not None, "a decode core has both"
        blocks = self.kv_connector.fetch(params)
        self.offload.put([bytes.fromhex(h) for h in params["hashes"][:len(blocks)]], salt, blocks)

    def _export_blocks(self, req: Request) -> dict:
        """The full blocks of a finished prefill's prompt, still in the prefix cache (freed, not yet reused)."""
        block_of = self.scheduler.kv.pool.prefix_cache.block_of
        hashes, blocks = [], []
        for block_hash in req.prompt_block_hashes:
            block_id = block_of.get(block_hash)
            if block_id is None:
                break
            hashes.append(block_hash)
            blocks.append(self.block_codec.gather(block_id))
        return self.kv_connector.export(blocks, hashes)

    def _admit(self, req: Request, after_prompt_of: str | None) -> None:
        first = self.scheduler.requests.get(after_prompt_of or "")
        if first is not None and self.config.cache_config.enable_prefix_caching and not self._prompt_done(first):
            self.deferred.setdefault(first.request_id, _Deferred(first)).siblings.append(req)
            return
        self.scheduler.add_request(req)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Hand the requests whose grammar is ready to the scheduler, after the tokens it forces from the start
        (they join the prompt's forward); fail those whose grammar did not compile in time or at all (the
        front checked it, so this is rare)."""
        if not self.structured.has_pending():
            return []
        ready, failed = self.structured.ready()
        outputs = []
        for req, after_prompt_of in ready:
            forced = self._fast_forward(req)
            if forced:  # its first token time stays that of its first sampled token (after the prompt's forward)
                outputs.append(self._output(req, forced, None))
            if not req.status.finished:
                self._admit(req, after_prompt_of)
        for req, error in failed:
            req.status, req.finished_time, req.error = RequestStatus.FINISHED_ERROR, time.monotonic(), error
            outputs.append(self._output(req, [], None))
        return outputs

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            for group in self.deferred.values():
                group.siblings = [r for r in group.siblings if r.request_id != request_id]
            self.scheduler.abort(request_id)
            self.structured.free(request_id)
        self._release_siblings()

    def purge_cache_salt(self, salt: str) -> int:
        """Forget the prefix-cache blocks of one cache salt (a deleted tenant): later requests with it miss.
        Requests running with it keep their blocks until they finish. Returns the blocks forgotten."""
        return self.scheduler.kv.purge(salt)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.deferred) or self.structured.has_pending()

    @staticmethod
    def _prompt_done(req: Request) -> bool:
        return req.status.finished or req.num_computed_tokens >= req.num_prompt_tokens - 1

    def _release_siblings(self) -> None:
        for first_id, group in list(self.deferred.items()):
            if self._prompt_done(group.first) or not group.siblings:
                for req in group.siblings:
                    self.scheduler.add_request(req)
                del self.deferred[first_id]

    # ---- one step ----
    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, sample, update: an output per request that advanced, finished or failed."""
        outputs = self._admit_compiled()
        out = self.scheduler.schedule()
        if out.is_empty():
            self._release_siblings()
            if self.structured.has_pending() and not outputs:
                self.structured.wait(0.01)  # nothing to compute but grammars: do not spin
            elif self.offload is not None and self.offload.pending and not outputs:
                self.offload.wait(0.01)  # nothing to compute but blocks coming from disk
            return outputs
        self.step_tokens.observe(sum(n for _, n in out.scheduled))
        flops = [self.flops(n, req.num_computed_tokens) for req, n in out.scheduled]
        start = self.meter.read()
        failed: list[Request] = []
        sampled = self._execute_isolating_failures(out, failed)
        outputs += [self._fail(req) for req in failed]
        self.scheduler.update_after_step(out)
        now = time.monotonic()
        hidden = {}
        if self.speculator is not None and self.speculator.needs_hidden:
            hidden = self._hidden_of_last_tokens(sampled)
        elif self.speculator is not None and self.speculator.needs_step_features:
            hidden = self.executor.step_features
        self._charge_energy(out, flops, self.meter.read() - start)
        outputs += [self._append(req, tokens, now) for req, tokens in sampled]
        if self.speculator is not None:
            start = self.meter.read()
            self.speculator.propose(self.scheduler.running, hidden)
            self.draft_energy += self.meter.read() - start  # the drafts' forward: charged with the next step
        self._release_siblings()
        return outputs

    def _charge_energy(self, out: SchedulerOutput, flops: list[float], joules: float) -> None:
        """The step's energy (and the drafting before it) to its requests, by their share of its FLOPs."""
        joules, self.draft_energy = joules + self.draft_energy, 0.0
        for (req, _), share in zip(out.scheduled, split_by_flops(joules, flops)):
            req.energy_j += share

    def _execute(self, out: SchedulerOutput) -> list[tuple[Request, list[SampledToken]]]:
        """Each sampling request's new tokens: one, or with drafts the accepted ones and the token after."""
        sampling = [r for r, n in out.scheduled if r.num_computed_tokens + n >= r.num_tokens]
        prompt_logprobs: dict[str, list] = {}
        logits = self.executor.execute(out, prompt_logprobs)
        if any(r.spec_token_ids for r in sampling):
            sampled = self._verify(sampling, logits)
        else:
            meta = build_sampling_metadata(sampling)
            meta.allowed_tokens = self.structured.allowed_tokens(sampling)
            sampled = [(req, [token]) for req, token in zip(sampling, self.sampler(logits, meta))]
        # Only once the whole step succeeded: a retried step adds nothing twice. Most steps have none.
        for req, _ in out.scheduled if prompt_logprobs else ():
            self._add_prompt_logprobs(req, prompt_logprobs.get(req.request_id))
        return sampled

    def _hidden_of_last_tokens(self, sampled: list[tuple[Request, list[SampledToken]]]) -> dict[str, torch.Tensor]:
        """Request id -> the hidden state whose logits gave its newest token: its rows come in order, 1 + k
        with drafts, and the newest token came from the row after its accepted drafts."""
        rows, start = self.executor.sampled_hidden, 0
        if sum(1 + len(req.spec_token_ids) for req, _ in sampled) != len(rows):
            return {}  # a step retried request by request: no drafts from it
        found = {}
        for req, tokens in sampled:
            found[req.request_id] = rows[start + len(tokens) - 1]
            start += 1 + len(req.spec_token_ids)
        return found

    def _verify(self, sampling: list[Request], logits: torch.Tensor) -> list[tuple[Request, list[SampledToken]]]:
        """A step with drafts: the requests without any sample as usual from their one row; each one with
        drafts has 1 + k rows, verified against its drafts (`rejection.verify`)."""
        starts = [0]
        for req in sampling:
            starts.append(starts[-1] + 1 + len(req.spec_token_ids))
        plain = [i for i, req in enumerate(sampling) if not req.spec_token_ids]
        result: list[list[SampledToken]] = [[] for _ in sampling]
        if plain:
            reqs = [sampling[i] for i in plain]
            meta = build_sampling_metadata(reqs)
            meta.allowed_tokens = self.structured.allowed_tokens(reqs)
            for i, token in zip(plain, self.sampler(logits[[starts[i] for i in plain]], meta)):
                result[i] = [token]
        for i, req in enumerate(sampling):
            if req.spec_token_ids:
                rows = build_sampling_metadata([req] * (1 + len(req.spec_token_ids)))
                result[i] = verify(logits[starts[i]:starts[i + 1]], rows, req.spec_token_ids)
        return list(zip(sampling, result))

    @staticmethod
    def _add_prompt_logprobs(req: Request, computed) -> None:
        """Keep the prompt positions not yet kept; a preempted request recomputes (and ignores) earlier ones."""
        if req.prompt_logprobs is None or not computed:
            return
        first_position, entries = computed
        have = len(req.prompt_logprobs)
        for position, (logprob, rank, top) in enumerate(entries, start=first_position):
            if position == have:
                req.prompt_logprobs.append(TokenLogprob(logprob, rank, top))
                have += 1

    def _execute_isolating_failures(self, out: SchedulerOutput, failed: list[Request]) -> list:
        """Run the step; if it raises, run each request alone, so only the ones that still fail are dropped
        and the rest of the batch advances as if nothing had happened."""
        try:
            return self._execute(out)
        except ExecutorDeadError:
            raise  # no request's fault, and no step can run: the engine must restart
        except Exception as exc:
            logger.warning("engine step failed (%s); retrying its %d requests one at a time",
                           type(exc).__name__, len(out.scheduled))
        sampled = []
        for req, num_new in out.scheduled:
            try:
                sampled += self._execute(SchedulerOutput([(req, num_new)]))
            except Exception as exc:
                logger.warning("request %s failed in the engine step (%s)", req.request_id, type(exc).__name__)
                failed.append(req)
        out.scheduled = [(r, n) for r, n in out.scheduled if r not in failed]
        return sampled

    def _fail(self, req: Request) -> EngineCoreOutput:
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        self.structured.free(req.request_id)
        return self._output(req, [], None)

    def _append(self, req: Request, tokens: list[SampledToken], now: float) -> EngineCoreOutput:
        if req.first_token_time is None:
            req.first_token_time = now
        if req.spec_token_ids:
            tokens = self._append_verified(req, tokens)
        else:
            self.scheduler.append_token(req, tokens[0].token_id)
        forced = []
        if self.structured.is_constrained(req.request_id):
            self._advance_grammar(req, tokens[0].token_id)
            forced = self._fast_forward(req)
        req.num_forced_tokens = len(forced)
        logprobs = None
        if tokens[0].logprob is not None:
            logprobs = [TokenLogprob(t.logprob, t.rank, t.top_logprobs or []) for t in tokens]
        output = self._output(req, [t.token_id for t in tokens] + forced, logprobs)
        if req.kv_export and req.status.finished:
            output.kv_transfer_params = self._export_blocks(req)
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            output.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return output

    def _append_verified(self, req: Request, tokens: list[SampledToken]) -> list[SampledToken]:
        """The accepted drafts and the token after them, up to the one that finishes the request (EOS, a stop
        token, max_tokens: the rest is dropped, as one-at-a-time decoding would never have produced it)."""
        num_drafts, appended = len(req.spec_token_ids), []
        for token in tokens:
            self.scheduler.append_token(req, token.token_id)
            appended.append(token)
            if req.status.finished:
                break
        self.speculator.record(req, num_drafts, len(tokens) - 1)
        self.scheduler.accept_drafts(req, len(appended) - 1)
        return appended

    def _fast_forward(self, req: Request) -> list[int]:
        """Append the tokens the grammar forces next (the only one its mask allows, one after another) without
        sampling them: token-by-token decoding could pick nothing else, so the output is the same, and the
        next step computes them in one forward. Not for a request that wants logprobs (a forced token's would
        need the forward that has not run yet), nor for EOS or stop tokens (the sampler's rules decide those)."""
        if not self.fast_forward or req.sampling_params.logprobs is not None:
            return []
        forced = []
        while not req.status.finished and (token := self._forced_token(req)) is not None:
            self._skip_draw(req)
            self.scheduler.append_token(req, token)
            self._advance_grammar(req, token)
            forced.append(token)
        self.structured.num_forced_tokens += len(forced)
        return forced

    def _forced_token(self, req: Request) -> int | None:
        token = self.structured.forced_token(req)
        if token is None or token in req.eos_token_ids or token in req.sampling_params.stop_token_ids:
            return None
        return token

    @staticmethod
    def _skip_draw(req: Request) -> None:
        """The uniform the sampler would have drawn for a forced token, drawn anyway: a seeded request samples
        the same tokens after it as token by token."""
        if req.generator is not None and not req.sampling_params.greedy:
            torch.rand(1, generator=req.generator)

    def _advance_grammar(self, req: Request, token_id: int) -> None:
        """The grammar takes the token; a complete grammar finishes the request ("stop", as EOS would)."""
        if not req.status.finished:
            verdict = self.structured.accept(req, token_id)
            if verdict is not None:
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED if verdict == "stop"
                                      else RequestStatus.FINISHED_ERROR)
        if req.status.finished:
            self.structured.free(req.request_id)

    def _output(self, req: Request, new_token_ids: list[int], logprobs: list[TokenLogprob] | None) -> EngineCoreOutput:
        stop_reason = req.stop_reason if isinstance(req.stop_reason, int) else None
        return EngineCoreOutput(req.request_id, new_token_ids, logprobs, req.finish_reason, stop_reason,
                                req.num_cached_tokens, req.num_preemptions, req.first_scheduled_time,
                                req.first_token_time, req.finished_time, error=req.error, energy_j=req.energy_j,
                                energy_source=self.meter.source)

    # ---- introspection ----
    def table_sizes(self) -> dict[str, int]:
        """Entries of every per-request table: all zero when nothing is in flight (a leak shows here)."""
        sched = self.scheduler
        return {"core_deferred": sum(1 + len(g.siblings) for g in self.deferred.values()),
                "scheduler_requests": len(sched.requests), "scheduler_waiting": len(sched.waiting),
                "scheduler_running": len(sched.running), **self.structured.table_sizes()}

    def on_idle(self) -> bool:
        """Work for an idle engine: the KV offload tier's disk writes, a batch at a time; True if more. Raises
        ExecutorDeadError if a tensor-parallel rank died meanwhile."""
        self.executor.check_alive()
        return self.offload is not None and self.offload.persist()

    def close(self) -> None:
        """Finish the KV offload tier's queued disk writes (bounded), so a restart finds them; stop the
        other tensor-parallel ranks."""
        if self.offload is not None:
            self.offload.close()
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.executor.close()

    def stats(self) -> dict:
        pool = self.scheduler.pool
        return {"num_requests_running": len(self.scheduler.running),
                "num_requests_waiting": len(self.scheduler.waiting), "kv_cache_usage_perc": pool.usage(),
                "prefix_cache_queries": pool.queries, "prefix_cache_hits": pool.hits,
                "num_preemptions": self.scheduler.num_preemptions, "tables": self.table_sizes(),
                "iteration_tokens": self.step_tokens.snapshot(), "num_blocks": pool.num_blocks,
                "structured_outputs": self.structured.stats(),
                "spec_decode": None if self.speculator is None else self.speculator.stats(),
                "kv_offload": None if self.offload is None else self.offload.snapshot(),
                "kv_transfer": None if self.kv_connector is None else self.kv_connector.snapshot(),
                "tensor_parallel": self.executor.stats()}
