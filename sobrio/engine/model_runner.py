"""Owns the model and its KV cache; turns a SchedulerOutput into one flat forward pass and its logits.

The cache (`sobrio.kv.cache.KVCache`) goes to the model with each step's attention metadata: the model
holds no reference to it.
"""

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from sobrio.config import ModelConfig, SobrioConfig
from sobrio.config.speculative import OPTION
from sobrio.distributed.parallel_model import parallelize
from sobrio.distributed.sharding import TPRank, local_config, shard_weights
from sobrio.engine.footprint import log_breakdown, weight_estimate
from sobrio.engine.lora import runner_adapters
from sobrio.errors import ConfigError, InvalidRequestError
from sobrio.kv.cache import KV_CACHE_DTYPES, KVCache, KVCacheSpec, kv_budget
from sobrio.layers.attention import AttentionMetadata
from sobrio.loader.load import LoadedModelFiles, quantization_cache
from sobrio.memory import huge_pages_in_background, reuse_step_buffers
from sobrio.models.llama import DecoderModel
from sobrio.models.registry import build_model
from sobrio.models.sizing import kv_cache_spec, resolve_dtype
from sobrio.models.weights import held_tensors, tensor_memory
from sobrio.speculative.eagle import EagleDraft, EagleFiles
from sobrio.timing import log_step
from sobrio.types.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

def quantization_in_use(model: ModelConfig, files: LoadedModelFiles) -> str | None:
    """`--quantization`, or the method of a checkpoint that is quantized without the flag (AWQ/GPTQ)."""
    return model.quantization or (files.quantization.method if files.quantization is not None else None)


@dataclass
class StepInputs:
    """One step, flat and plain (lists of ints): what the other tensor-parallel ranks receive."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    # (request id, first hidden row, first prompt position, the prompt tokens it scores, top n)
    prompt_scores: list[tuple[str, int, int, list[int], int]] = field(default_factory=list)
    adapters: list = field(default_factory=list)  # each request's LoRARequest or None (--enable-lora only)


class StepActivity:
    """Whether a model step ran lately. The start's background work on the weights waits for a quiet moment:
    on a 2-core host a thread that takes a core from one of a step's compute threads stalls both at the next
    barrier (docs/memory.md, "A step's buffers")."""

    QUIET_S = 0.1  # no step for this long: the engine is idle (decode steps follow each other within ms)

    def __init__(self):
        self.running, self.last_end = 0, 0.0

    def __enter__(self) -> None:
        self.running += 1

    def __exit__(self, *exc) -> None:
        self.running -= 1
        self.last_end = time.monotonic()

    def quiet(self) -> bool:
        return self.running == 0 and time.monotonic() - self.last_end > self.QUIET_S


class ModelRunner:
    def __init__(self, config: SobrioConfig, files: LoadedModelFiles, draft: LoadedModelFiles | None = None,
                 tp: TPRank | None = None):
        """`draft`: a smaller model of the same tokenizer (`draft_model` speculation), which gets its own KV
        cache of the same blocks; the KV memory budget is shared between the two in proportion. `tp`: this
        rank's share of a tensor-parallel model (its heads, channels, vocabulary rows and KV heads); every
        rank holds as many KV blocks, and the KV budget is per rank."""
        model, cache = config.model_config, config.cache_config
        self.tp = tp
        threads = config.parallel_config.num_threads
        if threads is None and tp is not None:  # the ranks of one host split its cores
            threads = max(1, available_cpus() // tp.group.size)
        if threads:
            torch.set_num_threads(threads)
        self.config = config
        self.activity = StepActivity()
        self.hf_config = files.config
        self.dtype = resolve_dtype(model.dtype)
        self.block_size = cache.block_size
        eagle = _eagle_files(config, files)
        draft_spec = self._plan_kv(files, draft, eagle)
        self.model = self._build(files, model.quantization, model.batch_invariant)
        assert [a.layer_idx for a in self.model.attention_layers()] == list(range(self.kv_spec.num_layers))
        self.lora = runner_adapters(config, self.model, files.config, self.dtype)
        self.kv_cache = KVCache.allocate(self.kv_spec, self.num_blocks)
        self.draft_model = self.draft_kv_cache = self.eagle = None
        if draft is not None:
            self.draft_model = self._build(draft, config.speculative_config.get("quantization"), False)
        if eagle is not None:
            self.eagle = EagleDraft(eagle, self.model, self.dtype, self.max_model_len,
                                    self.config.model_config.attention_backend,
                                    config.speculative_config.get("quantization"))
        if draft_spec is not None:
            self.draft_kv_cache = KVCache.allocate(draft_spec, self.num_blocks)
        self.step_hidden: torch.Tensor | None = None
        self.step_features: dict[str, tuple[int, torch.Tensor]] = {}
        logger.info("model %s loaded: dtype=%s quantization=%s kv_cache_dtype=%s kv_blocks=%d max_model_len=%d "
                    "batch_invariant=%s%s%s", files.source.name, self.dtype, quantization_in_use(model, files),
                    cache.kv_cache_dtype, self.num_blocks, self.max_model_len, model.batch_invariant,
                    "" if draft is None else f" draft_model={draft.source.name}", "" if tp is None else f" {tp}")
        log_breakdown(logger, files.source.name, [m for m in (self.model, self.draft_model) if m is not None],
                      [t for c in (self.kv_cache, self.draft_kv_cache) if c is not None for t in c.tensors()],
                      self.num_blocks)
        if eagle is not None:
            logger.info("EAGLE head for %s: %d draft tokens, its own KV cache of one layer", eagle.config["base_model"],
                        len(self.eagle.vocab_ids))
        reuse_step_buffers()
        with log_step(logger, "warming up %s", files.source.name):
            self.warm_up()
        models = [m for m in (self.model, self.draft_model) if m is not None]
        self.huge_pages = huge_pages_in_background(  # after the KV cache's pages, between steps only
            (tensor_memory(t) for m in models for t in held_tensors(m)), files.source.name, self.kv_cache.populating,
            self.activity.quiet)

    def settle(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the work the start left to the background (the KV cache's pages, the
        weights' huge pages); True once it is done. Benchmarks wait, as a served one's quiet gap does."""
        deadline = time.monotonic() + timeout
        threads = [t for t in (self.kv_cache.populating, self.huge_pages) if t is not None]
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def _plan_kv(self, files: LoadedModelFiles, draft: LoadedModelFiles | None,
                 eagle: EagleFiles | None) -> KVCacheSpec | None:
        """This rank's KV shape, how many blocks the budget holds (the widest rank's blocks decide, the draft's
        cache shares the budget in proportion) and the longest sequence; the draft's KV shape, if any."""
        model, cache, tp = self.config.model_config, self.config.cache_config, self.tp
        model_max = _max_positions(files.config, draft)
        if model.max_model_len is not None and model.max_model_len > model_max:
            raise InvalidRequestError(f"max_model_len {model.max_model_len} exceeds the model's {model_max}")
        cache_dtype = KV_CACHE_DTYPES[cache.kv_cache_dtype]
        self.rank_config = files.config if tp is None else local_config(files.config, tp.shard)
        self.kv_spec = kv_cache_spec(self.rank_config, self.dtype, self.block_size, cache_dtype)
        widest = self.kv_spec if tp is None else kv_cache_spec(tp.widest_config(files.config), self.dtype,
                                                               self.block_size, cache_dtype)
        draft_config = draft.config if draft is not None else (eagle.layer_config() if eagle is not None else None)
        draft_spec = None if draft_config is None else kv_cache_spec(draft_config, self.dtype, self.block_size,
                                                                     cache_dtype)
        weights = weight_estimate(files, self.dtype, model.quantization, 1 if tp is None else tp.group.size)
        budget = kv_budget(cache.kv_cache_memory, cache.kv_cache_memory_fraction, cache.kv_cache_memory_cap,
                           weights)
        if draft_spec is not None:
            budget = budget * self.kv_spec.block_bytes // (self.kv_spec.block_bytes + draft_spec.block_bytes)
        self.num_blocks = widest.num_blocks_for(budget)
        self.max_model_len = min(model.max_model_len or model_max, self.num_blocks * self.block_size)
        return draft_spec

    def _build(self, files: LoadedModelFiles, quantization: str | None, batch_invariant: bool):
        with log_step(logger, "loading the weights of %s", files.source.name):
            if self.tp is None or files.config is not self.hf_config:  # a draft model is not split
                cache = quantization_cache(self.config.model_config.quantization_cache, files, quantization,
                                           self.dtype)
                floats = files.quantization is None and not files.gguf_packed  # a layer's weights read again alone
                return build_model(files.config, self.max_model_len, files.iter_weights(in_place=True), self.dtype,
                                   self.config.model_config.attention_backend, batch_invariant, quantization,
                                   quantization_cache=cache,
                                   reread=(lambda: files.iter_weights(in_place=True)) if floats else None)
            weights = shard_weights(files.iter_weights(), files.config, self.tp.shard)
            model = build_model(self.rank_config, self.max_model_len, weights, self.dtype,
                                self.config.model_config.attention_backend, batch_invariant, quantization)
            parallelize(model, self.tp.shard, self.tp.group, files.config.vocab_size)
            return model

    def poll_between_layers(self, poll) -> None:
        """Call `poll` after each decoder layer of a step (the CPU governor's look; a clock read between looks)."""
        inner = getattr(self.model, "model", None)
        if isinstance(inner, DecoderModel):
            inner.between_layers = poll

    def warm_up(self) -> None:
        """One small prompt through the model, so the first request does not pay for loading the C++
        operators and for the kernels' first calls. It writes only KV block 0, which a request writes before
        it reads."""
        from sobrio.types.params import SamplingParams
        from sobrio.types.request import Request

        num_tokens = min(self.block_size, self.max_model_len)
        req = Request("warm-up", list(range(num_tokens)), SamplingParams(max_tokens=1), max_tokens=1)
        req.block_table = [0]
        self.execute(SchedulerOutput(scheduled=[(req, num_tokens)]))

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """Flatten the step into plain lists: token ids, positions, block tables, the rows whose logits are
        needed (a request's drafts follow its last token, and each of them needs its row too), and the prompt
        log-probabilities to score. Plain, so the scheduler's rank can send them to the other ranks."""
        step = StepInputs()
        for req, num_new in out.scheduled:
            start, end = req.num_computed_tokens, req.num_computed_tokens + num_new
            drafts = req.spec_token_ids
            assert end - req.num_tokens == len(drafts) or not drafts, "the scheduler trims the drafts"
            row = len(step.input_ids)
            step.input_ids += _token_slice(req, start, end - len(drafts)) + drafts
            step.positions += range(start, end)
            step.context_lens.append(end)
            step.query_start_loc.append(step.query_start_loc[-1] + num_new)
            step.block_tables.append(req.block_table)
            step.adapters.append(req.sampling_params.lora_request)
            if end >= req.num_tokens:
                step.sample_rows += range(step.query_start_loc[-1] - 1 - len(drafts), step.query_start_loc[-1])
            if req.prompt_logprobs is not None:
                begin = max(start, len(req.prompt_logprobs))
                stop = min(end, req.num_prompt_tokens - 1)
                if stop > begin:
                    step.prompt_scores.append((req.request_id, row + begin - start, begin,
                                               req.prompt_token_ids[begin + 1:stop + 1],
                                               req.sampling_params.prompt_logprobs or 0))
        return step

    def _metadata(self, block_tables: list[list[int]], seq_of_token: torch.Tensor, positions: torch.Tensor,
                  query_start_loc: list[int], context_lens: list[int], kv_cache: KVCache | None = None
                  ) -> AttentionMetadata:
        """Attention metadata of a flat batch: each token's KV slot comes from its request's block table;
        `kv_cache` defaults to the served model's."""
        width = max(len(table) for table in block_tables)
        tables = torch.tensor([table + [0] * (width - len(table)) for table in block_tables], dtype=torch.long)
        block_ids = tables[seq_of_token, positions // self.block_size]
        slot_mapping = block_ids * self.block_size + positions % self.block_size
        return AttentionMetadata(slot_mapping, query_start_loc, context_lens, tables, self.block_size,
                                 self.kv_cache if kv_cache is None else kv_cache)

    @torch.inference_mode()
    def draft(self, reqs: list, num_tokens: list[int], exit_layer: int | None = None) -> list[list[int]]:
        """Greedy drafts, num_tokens[i] for request i: from the model's first `exit_layer` layers, its final
        norm and its head (LayerSkip's self-speculation), or without `exit_layer` from the draft model on its
        own KV cache. The first pass feeds each request its newest token at the first position not computed
        (the draft model also the tokens before it whose KV it lacks: `Request.num_draft_kv`), each later
        pass the previous draft. The verifying step rewrites those slots, so the caller must have allocated
        them (positions up to num_computed_tokens + num_tokens[i] - 1)."""
        model, cache = (self.model, self.kv_cache) if exit_layer else (self.draft_model, self.draft_kv_cache)
        assert model is not None, "no draft model was loaded"
        positions = [req.num_computed_tokens for req in reqs]
        assert all(p + n <= len(r.block_table) * self.block_size for r, p, n in zip(reqs, positions, num_tokens))
        starts = [p if exit_layer else min(r.num_draft_kv, p) for r, p in zip(reqs, positions)]
        tokens = self._draft_pass(model, cache, reqs, [r.all_token_ids[s:p + 1] for r, s, p in
                                                       zip(reqs, starts, positions)], starts, exit_layer)
        drafts: list[list[int]] = [[t] for t in tokens]
        for step in range(1, max(num_tokens, default=0)):
            active = [i for i, n in enumerate(num_tokens) if n > step]
            guesses = self._draft_pass(model, cache, [reqs[i] for i in active], [[drafts[i][-1]] for i in active],
                                       [positions[i] + step for i in active], exit_layer)
            for i, token in zip(active, guesses):
                drafts[i].append(token)
        if not exit_layer:  # the draft model's KV now holds every position it was fed
            for req, p, n in zip(reqs, positions, num_tokens):
                req.num_draft_kv = p + n
        return drafts

    def _draft_metadata(self, reqs: list, token_ids: list[list[int]], starts: list[int], cache: KVCache
                        ) -> tuple[torch.Tensor, list[int], AttentionMetadata]:
        """Positions, query starts and attention metadata of a drafting pass: request i's tokens at positions
        from starts[i], on the drafter's KV cache."""
        lengths = torch.tensor([len(t) for t in token_ids])
        query_start_loc = [0] + torch.cumsum(lengths, 0).tolist()
        pos = torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, token_ids)])
        seq_of_token = torch.repeat_interleave(torch.arange(len(reqs)), lengths)
        context_lens = [s + len(t) for s, t in zip(starts, token_ids)]
        meta = self._metadata([r.block_table for r in reqs], seq_of_token, pos, query_start_loc, context_lens, cache)
        return pos, query_start_loc, meta

    def _eagle_pass(self, reqs: list, token_ids: list[list[int]], features: torch.Tensor, starts: list[int]
                    ) -> tuple[list[int], list[float], torch.Tensor]:
        """One forward of the EAGLE head on its KV cache: request i's tokens and their features at positions
        from starts[i]; the draft after each request's last position, the head's confidence in it, and the
        guessed feature it came from."""
        pos, query_start_loc, meta = self._draft_metadata(reqs, token_ids, starts, self.draft_kv_cache)
        guessed = self.eagle(torch.tensor([t for ids in token_ids for t in ids]), features, pos, meta)
        last = guessed[torch.tensor(query_start_loc[1:]) - 1]
        tokens, confidence = self.eagle.greedy(last)
        return tokens.tolist(), confidence.tolist(), last

    def _draft_pass(self, model, cache: KVCache, reqs: list, token_ids: list[list[int]], starts: list[int],
                    exit_layer: int | None) -> list[int]:
        """One forward of the drafting model: request i's `token_ids[i]` at positions from `starts[i]`; the
        argmax after each request's last token (over the served model's vocabulary: a draft's may be
        padded)."""
        pos, query_start_loc, meta = self._draft_metadata(reqs, token_ids, starts, cache)
        hidden = model(torch.tensor([t for ids in token_ids for t in ids]), pos, meta, num_layers=exit_layer)
        logits = model.compute_logits(hidden[torch.tensor(query_start_loc[1:]) - 1])
        return logits[:, :self.hf_config.vocab_size].argmax(dim=-1).tolist()

    @torch.inference_mode()
    def draft_eagle(self, reqs: list, num_tokens: list[int], starts: list[int], features: list[torch.Tensor],
                    min_confidence: float) -> list[list[int]]:
        """Greedy drafts of the EAGLE head, at most num_tokens[i] for request i. The first pass reads, for
        positions starts[i]..n-1 (n: its computed tokens), the target's features there and the tokens after
        them (the newest last), writing the head's KV; each later pass reads the head's own guessed feature
        and its draft. A request's drafts end before the first whose joint confidence (the product of the
        head's probabilities so far: EAGLE-2's estimate of its acceptance) is below `min_confidence`, so a
        guess the head doubts costs neither a drafting pass nor a verified row. The caller allocated the
        slots (up to n + num_tokens[i] - 2)."""
        n = [req.num_computed_tokens for req in reqs]
        assert all(len(f) == p - s for f, p, s in zip(features, n, starts))
        tokens = [req.all_token_ids[s + 1:p + 1] for req, s, p in zip(reqs, starts, n)]
        guesses, confidence, feats = self._eagle_pass(reqs, tokens, torch.cat(features), starts)
        drafts: list[list[int]] = [[] for _ in reqs]
        joint = [1.0] * len(reqs)
        active = list(range(len(reqs)))  # the requests the rows of `feats` belong to
        for step in range(max(num_tokens, default=0)):
            if step:
                guesses, confidence, feats = self._eagle_pass([reqs[i] for i in active],
                                                              [[drafts[i][-1]] for i in active], feats,
                                                              [n[i] + step - 1 for i in active])
            keep = _keep_confident(drafts, joint, active, guesses, confidence, min_confidence,
                                   [num_tokens[i] > step + 1 for i in active])
            active = [active[j] for j in keep]
            if not active:
                break
            feats = feats[torch.tensor(keep, dtype=torch.long)]
        return drafts

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """The final hidden states [len, d] of one sequence computed alone, in the KV cache's first blocks:
        for offline tools on an idle engine (`sobrio train-draft` reads the features the head will see)."""
        n = len(token_ids)
        assert n <= self.max_model_len, f"{n} tokens > max_model_len {self.max_model_len}"
        positions = torch.arange(n)
        meta = self._metadata([list(range(-(-n // self.block_size)))], torch.zeros(n, dtype=torch.long), positions,
                              [0, n], [n])
        if self.lora is not None:
            self.lora.prepare([None], [n])  # the base model's, not the last step's adapters
        return self.model(torch.tensor(token_ids), positions, meta)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, prompt_logprobs: dict | None = None) -> torch.Tensor:
        """Run one step; return float32 logits for the requests whose last token was computed. With a dict
        for `prompt_logprobs`, the requests that want them get theirs for this step's prompt positions."""
        logits = self.run(self.prepare_inputs(out), prompt_logprobs)
        if self.eagle is not None:  # the step's features by request (the EAGLE head reads them when drafting)
            self.step_features, row = {}, 0
            for req, num_new in out.scheduled:
                self.step_features[req.request_id] = (req.num_computed_tokens, self.step_hidden[row:row + num_new])
                row += num_new
        return logits

    def run(self, step: StepInputs, prompt_logprobs: dict | None = None) -> torch.Tensor:
        """The forward of flat step inputs (what every tensor-parallel rank runs, in the same order: each
        LM-head call is a collective). `prompt_logprobs[request_id] = (first position, [(logprob, rank,
        [(token id, logprob), ...top n]), ...])`, the LM head on at most 256 rows at a time."""
        with self.activity:
            return self._forward(step, prompt_logprobs)

    @torch.inference_mode()
    def _forward(self, step: StepInputs, prompt_logprobs: dict | None) -> torch.Tensor:
        positions = torch.tensor(step.positions, dtype=torch.long)
        lengths = torch.tensor(step.query_start_loc[1:]) - torch.tensor(step.query_start_loc[:-1])
        meta = self._metadata(step.block_tables, torch.repeat_interleave(torch.arange(len(lengths)), lengths),
                              positions, step.query_start_loc, step.context_lens)
        if self.lora is not None:
            self.lora.prepare(step.adapters, lengths.tolist())
        hidden = self.model(torch.tensor(step.input_ids), positions, meta)
        for request_id, row, begin, targets, top_n in step.prompt_scores:
            rows = hidden[row:row + len(targets)]
            scores = _score(self.model, rows, torch.tensor(targets, dtype=torch.long), top_n)
            if prompt_logprobs is not None:
                prompt_logprobs[request_id] = (begin, scores)
        self.step_hidden = hidden if self.eagle is not None else None
        self.sampled_hidden = hidden[torch.tensor(step.sample_rows, dtype=torch.long)]  # draft heads read these
        return self.model.compute_logits(self.sampled_hidden)


def _keep_confident(drafts: list[list[int]], joint: list[float], active: list[int], guesses: list[int],
                    confidence: list[float], floor: float, room: list[bool]) -> list[int]:
    """Append active request i's guess to its drafts while its joint confidence (times this guess's) stays at
    or above `floor`; the positions in `active` of those that draft again (room for one more)."""
    keep = []
    for j, i in enumerate(active):
        joint[i] *= confidence[j]
        if joint[i] >= floor:
            drafts[i].append(guesses[j])
            if room[j]:
                keep.append(j)
    return keep


def _score(model, rows: torch.Tensor, targets: torch.Tensor, top_n: int, chunk: int = 256) -> list[tuple]:
    """(logprob of each target, its rank, the top_n (token id, logprob)) for each row of hidden states."""
    entries = []
    for i in range(0, len(rows), chunk):
        logprobs = model.compute_logits(rows[i:i + chunk]).log_softmax(dim=-1)
        target = targets[i:i + chunk].unsqueeze(1)
        chosen = logprobs.gather(1, target)
        ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
        top = [[] for _ in ranks]
        if top_n:
            values, ids = logprobs.topk(top_n, dim=-1)
            top = [list(zip(i_row, v_row)) for i_row, v_row in zip(ids.tolist(), values.tolist())]
        entries += [(lp, rank, t) for lp, rank, t in zip(chosen.squeeze(1).tolist(), ranks, top)]
    return entries


def available_cpus() -> int:
    """The cores this process may run on (its affinity), which its ranks or replicas split between them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _eagle_files(config: SobrioConfig, files: LoadedModelFiles) -> EagleFiles | None:
    """The EAGLE head's files when the speculative method is eagle; one trained for another vocabulary
    (another tokenizer) or another width is refused."""
    spec = config.speculative_config
    if not spec.enabled or spec.get("method") != "eagle":
        return None
    eagle = EagleFiles.read(spec.get("model"))
    trained = (eagle.config["vocab_size"], eagle.config["layer"]["hidden_size"])
    if trained != (files.config.vocab_size, files.config.hidden_size):
        raise ConfigError(f"{OPTION}: the EAGLE head in {spec.get('model')} was trained for a model of vocabulary "
                          f"{trained[0]} and width {trained[1]} ({eagle.config['base_model']}), this one has "
                          f"{files.config.vocab_size} and {files.config.hidden_size}: another tokenizer or model",
                          OPTION)
    return eagle


def _max_positions(target, draft: LoadedModelFiles | None) -> int:
    """The longest context both the model and its draft model (if any) were built for."""
    configs = [target] if draft is None else [target, draft.config]
    return min(getattr(c, "max_position_embeddings", 2048) for c in configs)


def _token_slice(req, start: int, end: int) -> list[int]:
    prompt_len = req.num_prompt_tokens
    if start >= prompt_len:
        return req.output_token_ids[start - prompt_len:end - prompt_len]
    return req.prompt_token_ids[start:end] + req.output_token_ids[:max(0, end - prompt_len)]
