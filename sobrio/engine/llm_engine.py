"""The front of one engine: tokenize and validate, fan n sequences out, detokenize, stop strings, outputs.

Everything here works on text and token ids; the tensors live behind `EngineCore`. The front holds an
in-process core today; a client for a core in its own process speaks the same plain requests/outputs.
Single-threaded by design: `AsyncLLM` serializes calls.
"""

import hashlib
import logging
import time
from dataclasses import dataclass, field, replace

from sobrio.config import SobrioConfig
from sobrio.engine.adapters import AdapterRegistry
from sobrio.engine.core import EngineCore, EngineCoreOutput, EngineCoreRequest, TokenLogprob
from sobrio.engine.detokenize import IncrementalDetokenizer
from sobrio.engine.input import InputProcessor
from sobrio.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from sobrio.errors import ConfigError, EngineOverloadedError, InvalidRequestError
from sobrio.loader.load import LoadedModelFiles, load_model_files
from sobrio.structured.edge import GrammarGate
from sobrio.types.params import SamplingParams

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
    priority: int = 0
    kv_offload: bool | None = None  # may its KV go to the offload tiers (its tenant's policy); None: the server's


@dataclass
class _Sequence:
    """Front-side state of one output sequence: its place in the parent request, its text and tokens."""

    request_id: str
    parent_id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    num_tokens_sent: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # finish_reason "error" by the request's own fault: why


class LLMEngine:
    def __init__(self, config: SobrioConfig, core=None, files: LoadedModelFiles | None = None):
        """`core`: an in-process EngineCore by default, or a handle with its interface (`CoreProcess`)."""
        self.config = config
        if core is None:
            _one_core_in_process(config)
        files = files or load_model_files(config.model_config)
        self.model_name = files.source.name
        self.tokenizer = files.tokenizer
        self.hf_config = files.config
        self.adapters = AdapterRegistry(config.lora_config, files.config)
        self.adapters.register_modules()
        self.core = core if core is not None else EngineCore(config, files)
        self.max_model_len = self.core.max_model_len
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, self.hf_config.vocab_size,
                                              config.model_config.max_logprobs)
        self.default_sampling = files.default_sampling  # --generation-config: for fields a request leaves unset
        self.num_requests_added = 0  # numbers the unseeded requests' seeds (--seed)
        self.eos_token_ids = self._eos_token_ids()
        # grammars compile here, bounded, before a request is queued (a bad one is a 400, never an engine failure)
        self.grammar_gate = GrammarGate(lambda: self.tokenizer,
                                        config.structured_outputs_config.structured_outputs_compile_timeout)
        self.sequences: dict[str, _Sequence] = {}  # child request id -> sequence
        self.children: dict[str, list[str]] = {}  # parent request id -> child request ids

    def _eos_token_ids(self) -> frozenset[int]:
        ids = self.hf_config.eos_token_id
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # in-process introspection, for tests and benchmarks
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def runner(self):
        return self.core.executor.runner

    # ---- requests in ----
    def process_input(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                      cache_salt: str | None = None, arrival_time: float | None = None,
                      prompt_token_ids: list[int] | None = None, priority: int = 0,
                      kv_offload: bool | None = None) -> ProcessedRequest:
        """Tokenize and validate, touching no engine state: safe on any thread, outside the step's lock."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be a SamplingParams")
        self._check_priority(priority)
        self.input_processor.validate_params(params, cache_salt)
        if params.lora_request is not None:
            self.adapters.check(params.lora_request)
        if params.structured_outputs is not None:  # a bad schema, regex or grammar: refused before queuing
            self.grammar_gate.check(params.structured_outputs, self.eos_token_ids)
        ids = self.input_processor.tokenize(prompt_token_ids if prompt_token_ids is not None else prompt)
        max_tokens = self.input_processor.resolve_max_tokens(len(ids), params)
        text_prompt = prompt if isinstance(prompt, str) else None
        return ProcessedRequest(request_id, text_prompt, ids, params, max_tokens, cache_salt,
                                arrival_time or time.monotonic(), priority, kv_offload)

    def _check_priority(self, priority: int) -> None:
        """vLLM's rule: a priority other than 0 needs --scheduling-policy priority."""
        if not isinstance(priority, int) or isinstance(priority, bool) or not -2**63 <= priority < 2**63:
            raise InvalidRequestError("priority must be a 64-bit integer", param="priority")
        if priority and self.config.scheduler_config.scheduling_policy != "priority":
            raise InvalidRequestError("priority is set but priority scheduling is not enabled "
                                      "(start the server with --scheduling-policy priority)", param="priority")

    def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None, priority: int = 0) -> None:
        """Validate and queue a request (n sequences share its id). Raises InvalidRequestError."""
        self.add_processed(self.process_input(request_id, prompt, params, cache_salt, arrival_time,
                                              prompt_token_ids, priority))

    def add_processed(self, p: ProcessedRequest) -> None:
        """Queue a processed request. Every object is built before any table is touched, so a request that
        fails here leaves nothing behind."""
        if p.request_id in self.children:
            raise InvalidRequestError(f"request id {p.request_id!r} is already in use")
        if self.num_waiting() + p.params.n > self.config.scheduler_config.max_num_waiting:
            raise EngineOverloadedError("the waiting queue is full; retry later")
        self.num_requests_added += 1
        if p.params.seed is None and not p.params.greedy:  # --seed: the same answers after a restart
            p.params = replace(p.params, seed=derived_seed(self.config.model_config.seed, self.num_requests_added))
        seqs = [self._new_sequence(p, index) for index in range(p.params.n)]
        self.children[p.request_id] = [seq.request_id for seq in seqs]
        for seq in seqs:
            self.sequences[seq.request_id] = seq
        first = seqs[0].request_id
        for seq in seqs:
            self.core.add_request(EngineCoreRequest(
                seq.request_id, p.prompt_token_ids, seq.params, p.max_tokens, self.eos_token_ids, p.cache_salt,
                p.arrival_time, priority=p.priority, kv_offload=p.kv_offload,
                after_prompt_of=None if seq.request_id == first else first))

    def _new_sequence(self, p: ProcessedRequest, index: int) -> _Sequence:
        params = _child_params(p.params, index)
        child_id = p.request_id if p.params.n == 1 else f"{index}_{p.request_id}"
        detok = IncrementalDetokenizer(self.tokenizer.backend_tokenizer, params)
        return _Sequence(child_id, p.request_id, index, p.prompt, p.prompt_token_ids, params, detok, p.arrival_time)

    def abort_request(self, request_id: str) -> None:
        child_ids = self.children.pop(request_id, [])
        self.core.abort_requests(child_ids)
        for child_id in child_ids:
            self.sequences.pop(child_id, None)

    def purge_cache_salt(self, salt: str) -> None:
        """Forget every prefix-cache block of this cache salt (deleting a tenant)."""
        self.core.purge_cache_salt(salt)

    def forget_all(self) -> None:
        """Drop every sequence (their core is gone)."""
        self.sequences.clear()
        self.children.clear()

    def forget(self, core_request_ids: list[str]) -> list[str]:
        """Drop the requests these core requests belong to (a replica that died held them): their ids."""
        parents = {self.sequences[c].parent_id for c in core_request_ids if c in self.sequences}
        for parent in parents:
            for child_id in self.children.pop(parent, []):
                self.sequences.pop(child_id, None)
        return sorted(parents)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        """One core step; an output per sequence that advanced, finished or failed."""
        return self.process_outputs(self.core.step())

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for out in core_outputs:
            seq = self.sequences.get(out.request_id)
            if seq is None:  # finished here already (a stop string, a failed sibling): late tokens are dropped
                continue
            if out.finish_reason == "error":
                outputs += self._fail(seq.parent_id, out.error)
            else:
                outputs.append(self._advance(seq, out))
        return outputs

    def _advance(self, seq: _Sequence, out: EngineCoreOutput) -> RequestOutput:
        if out.prompt_logprobs is not None:
            prompt = seq.prompt_token_ids
            seq.prompt_logprobs = [None] + [self._logprob_dict(prompt[k + 1], lp)
                                            for k, lp in enumerate(out.prompt_logprobs)]
        for i, token_id in enumerate(out.new_token_ids):
            seq.token_ids.append(token_id)
            if out.new_logprobs is not None:
                seq.logprobs.append(self._logprob_dict(token_id, out.new_logprobs[i]))
            stop = seq.detok.add(token_id)
            if stop is not None:
                self.core.abort_requests([seq.request_id])  # the core stops computing it now
                seq.finish_reason, seq.stop_reason = "stop", stop
                break
        if seq.finish_reason is None and out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        return self._make_output(seq, out)

    def _fail(self, parent_id: str, error: str | None = None) -> list[RequestOutput]:
        """One sequence failed in the core: the whole request fails (finish_reason "error"), siblings too;
        `error`: why, when it was the request's own fault."""
        child_ids = self.children.get(parent_id, [])
        self.core.abort_requests(child_ids)
        outputs = []
        for child_id in child_ids:
            seq = self.sequences.get(child_id)
            if seq is not None:
                seq.finish_reason, seq.error = "error", error
                outputs.append(self._make_output(seq, None))
        return outputs

    def _logprob_dict(self, token_id: int, lp: TokenLogprob) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        entries = {tid: Logprob(value, rank + 1, decode([tid])) for rank, (tid, value) in enumerate(lp.top)}
        entries[token_id] = Logprob(lp.logprob, lp.rank, decode([token_id]))
        return entries

    def _make_output(self, seq: _Sequence, out: EngineCoreOutput | None) -> RequestOutput:
        finished = seq.finish_reason is not None
        delta_ids = seq.token_ids[seq.num_tokens_sent:]
        seq.num_tokens_sent = len(seq.token_ids)
        logprobs = seq.logprobs if seq.params.logprobs is not None else None
        cumulative = sum(d[t].logprob for d, t in zip(logprobs, seq.token_ids)) if logprobs else None
        completion = CompletionOutput(seq.index, seq.detok.text, list(seq.token_ids), seq.finish_reason,
                                      seq.stop_reason, logprobs, cumulative)
        finished_time = ((out and out.finished_time) or time.monotonic()) if finished else None
        metrics = RequestMetrics(seq.arrival_time, out and out.first_scheduled_time, out and out.first_token_time,
                                 finished_time, out.num_preemptions if out else 0,
                                 len(self.children.get(seq.parent_id, ())) or 1, seq.params.max_tokens,
                                 out.energy_j if out else 0.0, out and out.energy_source)
        result = RequestOutput(seq.parent_id, seq.prompt, seq.prompt_token_ids, [completion], finished, metrics,
                               out.num_cached_tokens if out else 0, seq.detok.delta(finished), delta_ids,
                               seq.prompt_logprobs, seq.error)
        if finished:
            self._forget(seq)
        return result

    def _forget(self, seq: _Sequence) -> None:
        self.sequences.pop(seq.request_id, None)
        siblings = self.children.get(seq.parent_id, [])
        if all(c not in self.sequences for c in siblings):
            self.children.pop(seq.parent_id, None)

    def num_waiting(self, stats: dict | None = None) -> int:
        """Sequences not yet running. A core in another process reports its counts once a step, so the
        front also counts what it sent since: its live sequences less the core's running ones."""
        stats = stats or self.core.stats()
        return max(stats["num_requests_waiting"], len(self.sequences) - stats["num_requests_running"])

    def table_sizes(self, core_tables: dict[str, int] | None = None) -> dict[str, int]:
        """Entries of every per-request table, front and core: all zero when nothing is in flight."""
        core_tables = self.core.table_sizes() if core_tables is None else core_tables
        return {"front_sequences": len(self.sequences), "front_children": len(self.children), **core_tables}

    def stats(self) -> dict:
        stats = self.core.stats()
        return {**stats, "num_requests_waiting": self.num_waiting(stats), "tables": self.table_sizes(stats["tables"])}


def _one_core_in_process(config: SobrioConfig) -> None:
    """An in-process engine is one core: replicas and a prefill/decode pair need `sobrio serve`'s engine
    processes (refused, not silently ignored)."""
    if config.parallel_config.data_parallel_size > 1:
        raise ConfigError("--data-parallel-size > 1 runs engine-core processes behind `sobrio serve` (not offline, "
                          "nor with --engine-process false)", "--data-parallel-size")
    if config.kv_transfer_config.enabled:
        raise ConfigError("--kv-transfer-config runs a prefill and a decode engine-core process behind `sobrio "
                          "serve` (not offline, nor with --engine-process false)", "--kv-transfer-config")


def derived_seed(engine_seed: int, number: int) -> int:
    """The seed of the number-th request that came without one: a hash of the engine's --seed and that number,
    so a restarted server samples the same answers to the same requests in the same order (vLLM seeds one
    global generator; one seed per request also keeps a request's tokens independent of its batch)."""
    digest = hashlib.blake2b(f"{engine_seed}:{number}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each of n sequences gets its own seed (seed + index), so seeded n > 1 still differs per sequence."""
    if params.n == 1:
        return params
    return replace(params, n=1, seed=params.child_seed(index))
