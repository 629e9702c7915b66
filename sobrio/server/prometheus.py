"""Prometheus metrics under vLLM's names, labels and buckets (vllm/v1/metrics/loggers.py), with the prefix
`sobrio:` (default) or `vllm:` (`--metrics-prefix vllm`, for existing vLLM dashboards). Never any request text.

Every family carries vLLM's labels `model_name` and `engine` (always "0": one engine per served model), and
every series of a served model exists from start-up (zero), not from its first request. vLLM's families that
need a feature sobrio lacks (LoRA, KV connectors, multi-modal caches, sleep mode) are absent; the
speculative-decoding ones (`spec_decode_*`) exist for a model served with `--speculative-config`. sobrio's
own families keep the `sobrio:` prefix whichever is chosen (`sobrio:request_table_entries`).

Where each value comes from:
- scrape time, from each engine's `stats()` (a typed `EngineStats`): the scheduler gauges, the prefix-cache
  and preemption counters, the engine-step token histogram (`iteration_tokens_total`, counted in the engine
  core), cache config info, structured output (`sobrio:structured_output_*`: requests, forced tokens, grammar
  cache hits and misses, grammar compile time, all counted in the engine core), speculative decoding (drafts,
  draft and accepted tokens, accepted by position);
- each output of each sequence (`observe`, on the engine's output thread): tokens, latencies, request sizes;
- each finished embedding request (`observe_embedding`, on the embedding worker).
"""

import dataclasses
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from sobrio.engine.client import EmbeddingRequestStats, EngineClient, EngineStats, HistogramCounts, Served
from sobrio.engine.outputs import RequestOutput

METRICS_PREFIXES = ("sobrio", "vllm")
ENGINE = "0"  # vLLM's `engine` label: the data-parallel rank ("0" for one core; a group's members: their names)
FINISHED_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason, as its label values
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # vLLM's PromptTokenStats

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class EngineStatsCollector:
    """Reads the engines' live state at scrape time: gauges, cumulative counters, the step-token histogram
    (the core keeps its bucket counts) and the cache configuration."""

    def __init__(self, engines: dict[str, Served], prefix: str, own_tables=lambda: {}):
        self.engines = engines
        self.prefix = prefix
        self.own_tables = own_tables  # the server's per-request tables, counted beside the engines'

    def collect(self):
        p, labels = self.prefix, ["model_name", "engine"]
        gauges = {name: GaugeMetricFamily(f"{p}:{name}", doc, labels=labels) for name, doc in [
            ("num_requests_running", "Number of requests in model execution batches."),
            ("num_requests_waiting", "Number of requests waiting to be processed."),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")]}
        counters = {name: CounterMetricFamily(f"{p}:{name}", doc, labels=labels) for name, doc in [
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
            ("num_preemptions", "Cumulative number of preemption from the engine.")]}
        steps = HistogramMetricFamily(f"{p}:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                      labels=labels)
        cache_infos, generating = [], []
        tables = GaugeMetricFamily("sobrio:request_table_entries", "Entries of each per-request table (a "
                                   "request that left one behind shows here once idle)", labels=["model_name", "table"])
        for model_name, engine in self.engines.items():
            stats = engine.stats()
            if engine.task == "generate":
                generating.append((model_name, stats))
                cache_infos.append({"model_name": model_name, "engine": ENGINE, **cache_config_info(engine, stats)})
            for member in stats.cores():  # data-parallel replicas, prefill and decode cores
                for name, family in {**gauges, **counters}.items():
                    family.add_metric([model_name, engine_label(member)], getattr(member, name))
            steps.add_metric([model_name, ENGINE], *histogram(stats.iteration_tokens))
            for table, size in {**stats.tables, **self.own_tables()}.items():
                tables.add_metric([model_name, table], size)
        yield from gauges.values()
        yield from counters.values()
        yield steps
        yield from structured_output_families(generating)
        yield from spec_decode_families(p, generating)
        yield from kv_offload_families(generating)
        yield from kv_transfer_families(p, generating)
        yield from tensor_parallel_families(p, generating)
        yield from engine_fault_families(generating)
        yield from cache_config_family(p, cache_infos)
        yield tables


def cache_config_family(prefix: str, cache_infos: list[dict[str, str]]):
    """vLLM's cache_config_info, one label set for the family: every engine's keys (none without a KV cache)."""
    if cache_infos:
        keys = list(dict.fromkeys(k for info in cache_infos for k in info))
        family = GaugeMetricFamily(f"{prefix}:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=keys)
        for info in cache_infos:
            family.add_metric([info.get(k, "") for k in keys], 1)
        yield family


def engine_fault_families(generating: list[tuple[str, EngineStats]]):
    """What the engine thread survived: callback errors by type, and its own deaths (each a restart)."""
    errors = CounterMetricFamily("sobrio:engine_callback_errors", "Errors raised by a callback on the engine's "
                                 "delivery path (metrics, logs), by type; the requests went on",
                                 labels=["model_name", "error"])
    deaths = CounterMetricFamily("sobrio:engine_thread_deaths", "Times the engine thread died and was restarted "
                                 "(its requests failed)", labels=["model_name"])
    for model_name, stats in generating:
        for error, count in stats.callback_errors.items():
            errors.add_metric([model_name, error], count)
        deaths.add_metric([model_name], stats.engine_thread_deaths)
    yield errors
    yield deaths


def histogram(counts: HistogramCounts) -> tuple[list[tuple[str, int]], float]:
    """Per-bucket counts (the last past the largest bound) -> Prometheus' cumulative (le, count) pairs, sum."""
    cumulative, buckets = 0, []
    for bound, count in zip([*map(floatToGoString, counts.bounds), "+Inf"], counts.counts):
        cumulative += count
        buckets.append((bound, cumulative))
    return buckets, counts.total


STRUCTURED_COUNTERS = (
    ("requests", "requests", "Requests with structured output (a JSON schema, regex, choice or grammar)."),
    ("forced_tokens", "forced_tokens", "Output tokens a grammar forced, emitted without sampling (fast-forward)."),
    ("grammar_cache_hits", "cache_hits", "Grammar compiles served by the compiled-grammar cache."),
    ("grammar_cache_misses", "cache_misses", "Grammar compiles not in the compiled-grammar cache (compiled)."))


def structured_output_families(generating: list[tuple[str, EngineStats]]):
    """sobrio's structured-output families (`sobrio:` whatever the prefix: vLLM has none): counters, and the
    histogram of grammar compile times, from each generating model's core stats (zero before any)."""
    labels = ["model_name", "engine"]
    counters = {key: CounterMetricFamily(f"sobrio:structured_output_{name}", doc, labels=labels)
                for name, key, doc in STRUCTURED_COUNTERS}
    compile_time = HistogramMetricFamily("sobrio:structured_output_grammar_compile_seconds",
                                         "Time to compile a grammar against the tokenizer (cache misses).",
                                         labels=labels)
    for model_name, all_stats in generating:
        stats = all_stats.structured_outputs
        for key, family in counters.items():
            family.add_metric([model_name, ENGINE], getattr(stats, key))
        compile_time.add_metric([model_name, ENGINE], *histogram(stats.compile_seconds))
    yield from counters.values()
    yield compile_time


SPEC_DECODE_COUNTERS = (
    ("num_drafts", "Number of spec decoding drafts."),
    ("num_draft_tokens", "Number of draft tokens."),
    ("num_accepted_tokens", "Number of accepted tokens."))


def spec_decode_families(prefix: str, generating: list[tuple[str, EngineStats]]):
    """vLLM's speculative-decoding counters, for the models that speculate (absent for the others, as in
    vLLM): drafts, draft tokens, accepted tokens, and accepted tokens by draft position."""
    labels = ["model_name", "engine"]
    counters = {key: CounterMetricFamily(f"{prefix}:spec_decode_{key}", doc, labels=labels)
                for key, doc in SPEC_DECODE_COUNTERS}
    per_position = CounterMetricFamily(f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
                                       "Accepted tokens per draft position.", labels=[*labels, "position"])
    speculating = [(name, stats.spec_decode) for name, stats in generating if stats.spec_decode is not None]
    for model_name, stats in speculating:
        for key, family in counters.items():
            family.add_metric([model_name, ENGINE], getattr(stats, key))
        for position, count in enumerate(stats.accepted_per_position):
            per_position.add_metric([model_name, ENGINE, str(position)], count)
    if speculating:
        yield from counters.values()
        yield per_position


def kv_offload_families(generating: list[tuple[str, EngineStats]]):
    """The KV offload tiers (kv/offload.py) of the models that have them: hits per tier, misses, bytes per
    tier, load time, blocks failing authentication, disk faults."""
    labels = ["model_name", "engine"]
    offloading = [(name, stats.kv_offload) for name, stats in generating if stats.kv_offload is not None]
    if not offloading:
        return
    hits = CounterMetricFamily("sobrio:kv_offload_hits", "KV blocks loaded back from an offload tier.",
                               labels=[*labels, "tier"])
    stored = CounterMetricFamily("sobrio:kv_offload_stored", "KV blocks stored in an offload tier.",
                                 labels=[*labels, "tier"])
    size = GaugeMetricFamily("sobrio:kv_offload_bytes", "Bytes held by an offload tier.", labels=[*labels, "tier"])
    misses = CounterMetricFamily("sobrio:kv_offload_misses", "Prefix lookups past the pool whose next block "
                                 "this tier did not hold.", labels=[*labels, "tier"])
    plain = {key: CounterMetricFamily(f"sobrio:kv_offload_{key}", doc, labels=labels) for key, doc in (
        ("loads", "Blocks read and decrypted from disk."),
        ("load_seconds", "Seconds spent reading and decrypting blocks from disk (per block: / loads)."),
        ("auth_failures", "Blocks that failed authentication (tampered, truncated, another key): recomputed."),
        ("disk_errors", "Disk tier faults (full, read-only, unreadable): those blocks are recomputed."))}
    for model_name, stats in offloading:
        for tier in ("ram", "disk"):
            hits.add_metric([model_name, ENGINE, tier], getattr(stats, f"hits_{tier}"))
            stored.add_metric([model_name, ENGINE, tier], getattr(stats, f"stored_{tier}"))
            size.add_metric([model_name, ENGINE, tier], getattr(stats, f"{tier}_bytes"))
            misses.add_metric([model_name, ENGINE, tier], getattr(stats, f"misses_{tier}"))
        for key, family in plain.items():
            family.add_metric([model_name, ENGINE], getattr(stats, key))
    yield from (hits, stored, size, misses, *plain.values())


def engine_label(stats: EngineStats) -> str:
    """A group member's `engine` label: a data-parallel rank ("0", "1"), "prefill" or "decode"; one core: "0"."""
    return stats.name.removeprefix("dp")


def kv_transfer_families(prefix: str, generating: list[tuple[str, EngineStats]]):
    """Disaggregated serving: bytes and seconds of KV blocks exported by prefill cores and imported by decode
    cores (their ratio is the transfer rate)."""
    labels = ["model_name", "engine"]
    sent = CounterMetricFamily(f"{prefix}:kv_transfer_bytes_sent", "KV-block bytes a prefill core exported",
                               labels=labels)
    received = CounterMetricFamily(f"{prefix}:kv_transfer_bytes_received", "KV-block bytes a decode core imported",
                                   labels=labels)
    seconds = CounterMetricFamily(f"{prefix}:kv_transfer_seconds", "Seconds a core spent exporting and importing "
                                  "KV blocks", labels=labels)
    for model_name, stats in generating:
        for member in stats.cores():
            transfer = member.kv_transfer
            if transfer is not None:
                label = [model_name, engine_label(member)]
                sent.add_metric(label, transfer.bytes_sent)
                received.add_metric(label, transfer.bytes_received)
                seconds.add_metric(label, transfer.seconds_exporting + transfer.seconds_importing)
    yield from (sent, received, seconds)


def tensor_parallel_families(prefix: str, generating: list[tuple[str, EngineStats]]):
    """Tensor parallelism, as rank 0 sees it: its ranks, and its collectives' calls, bytes and seconds."""
    labels = ["model_name", "engine", "collective"]
    ranks = GaugeMetricFamily(f"{prefix}:tensor_parallel_size", "Ranks one model is split across",
                              labels=labels[:2])
    families = {key: CounterMetricFamily(f"{prefix}:tensor_parallel_collective_{key}", doc, labels=labels)
                for key, doc in [("calls", "Collectives run by rank 0"),
                                 ("bytes", "Bytes rank 0 put into its collectives"),
                                 ("seconds", "Seconds rank 0 spent in collectives (waiting for the others included)")]}
    for model_name, stats in generating:
        for member in stats.cores():
            tp = member.tensor_parallel
            if tp is not None:
                ranks.add_metric([model_name, engine_label(member)], tp.size)
                for collective in ("all_reduce", "all_gather"):
                    for key, family in families.items():
                        family.add_metric([model_name, engine_label(member), collective],
                                          getattr(getattr(tp, collective), key))
    yield ranks
    yield from families.values()


def cache_config_info(engine: EngineClient, stats: EngineStats) -> dict[str, str]:
    """vLLM's cache_config_info labels: the cache config's fields as text, and the KV blocks allocated
    (`num_gpu_blocks`, vLLM's name, though here they are in RAM)."""
    info = {k: str(v) for k, v in dataclasses.asdict(engine.config.cache_config).items()}
    info["num_gpu_blocks"] = "" if stats.num_blocks is None else str(stats.num_blocks)
    return info


# vLLM's per-request histograms: attribute, name, help, buckets ("tokens": 1-2-5 steps up to the context)
HISTOGRAMS = (
    ("request_prompt_tokens", "request_prompt_tokens", "Number of prefill tokens processed.", "tokens"),
    ("request_generation_tokens", "request_generation_tokens", "Number of generation tokens processed.", "tokens"),
    ("request_max_num_generation_tokens", "request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.", "tokens"),
    ("request_params_n", "request_params_n", "Histogram of the n request parameter.", N_BUCKETS),
    ("request_params_max_tokens", "request_params_max_tokens", "Histogram of the max_tokens request parameter.",
     "tokens"),
    ("request_prefill_kv_computed_tokens", "request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).", "tokens"),
    ("ttft", "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("itl", "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    # vLLM's name for the same until 0.11 (hidden since); many dashboards still read it
    ("tpot", "time_per_output_token_seconds", "Histogram of time per output token in seconds."
     "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", ITL_BUCKETS),
    ("request_tpot", "request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
    ("e2e", "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    ("queue_time", "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("inference_time", "request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("prefill_time", "request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("decode_time", "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
     REQUEST_LATENCY_BUCKETS))


class ServerMetrics:
    def __init__(self, engines: dict[str, Served], prefix: str = "sobrio"):
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(METRICS_PREFIXES)}")
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(engines, prefix, self.table_sizes))
        labels = ["model_name", "engine"]

        def counter(name, doc, extra=()):
            return Counter(f"{prefix}:{name}", doc, labels + list(extra), registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_by_source = counter("prompt_tokens_by_source", "Number of prompt tokens by source.",
                                               ["source"])
        self.prompt_tokens_cached = counter("prompt_tokens_cached", "Number of cached prompt tokens (local + "
                                            "external).")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("request_success", "Count of successfully processed requests.",
                                       ["finished_reason"])
        token_buckets = build_1_2_5_buckets(max((e.max_model_len for e in engines.values()), default=1))
        for attr, name, doc, buckets in HISTOGRAMS:
            setattr(self, attr, Histogram(f"{prefix}:{name}", doc, labels, registry=self.registry,
                                          buckets=token_buckets if buckets == "tokens" else buckets))
        self._start_series(engines)
        self._last_token_time: dict[tuple[str, int], float] = {}
        self._parents: dict[str, list[int]] = {}  # request id of n > 1 -> [sequences left, most tokens of one]
        self._lock = threading.Lock()  # observe runs on engine threads, forget on those or the event loop

    def _start_series(self, engines: dict[str, Served]) -> None:
        """Every series from start-up, as vLLM's make_per_engine does."""
        for model_name in engines:
            for metric in self._per_model():
                metric.labels(model_name, ENGINE)
            for reason in FINISHED_REASONS:
                self.request_success.labels(model_name, ENGINE, reason)
            for source in PROMPT_TOKEN_SOURCES:
                self.prompt_tokens_by_source.labels(model_name, ENGINE, source)

    def _per_model(self) -> list:
        return [self.prompt_tokens, self.prompt_tokens_cached, self.generation_tokens,
                *(getattr(self, attr) for attr, *_ in HISTOGRAMS)]

    def table_sizes(self) -> dict[str, int]:
        return {"metrics_inter_token": len(self._last_token_time), "metrics_parents": len(self._parents)}

    def forget(self, request_id: str) -> None:
        """An aborted request sends no final output: drop its inter-token and n bookkeeping."""
        with self._lock:
            for key in [k for k in self._last_token_time if k[0] == request_id]:
                del self._last_token_time[key]
            self._parents.pop(request_id, None)

    def observe(self, model_name: str, output: RequestOutput, now: float) -> None:
        """Called by the engine thread for each output of each sequence (monotonic seconds)."""
        seq = output.outputs[0]
        key = (output.request_id, seq.index)
        with self._lock:
            last = self._last_token_time.get(key)
            self._last_token_time[key] = now
            if output.finished:
                self._last_token_time.pop(key, None)
        labels = (model_name, ENGINE)
        new_tokens = len(output.delta_token_ids)
        m = output.metrics
        if last is None:
            self.ttft.labels(*labels).observe(now - m.arrival_time)
        elif new_tokens:
            itl = (now - last) / new_tokens
            self.itl.labels(*labels).observe(itl)
            self.tpot.labels(*labels).observe(itl)
        self.generation_tokens.labels(*labels).inc(new_tokens)
        if output.finished:
            self._observe_finished(labels, output, now)

    def _observe_finished(self, labels: tuple[str, str], output: RequestOutput, now: float) -> None:
        seq, m = output.outputs[0], output.metrics
        num_prompt, num_cached = len(output.prompt_token_ids), output.num_cached_tokens
        num_generated = len(seq.token_ids)
        if seq.index == 0:  # the n sequences share one prompt: counted once
            self._count_prompt(labels, num_prompt, num_cached)
        self.request_success.labels(*labels, seq.finish_reason or "stop").inc()
        end = m.finished_time or now
        self.e2e.labels(*labels).observe(now - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.labels(*labels).observe(m.first_scheduled_time - m.arrival_time)
            self.inference_time.labels(*labels).observe(end - m.first_scheduled_time)
            if m.first_token_time is not None:
                self.prefill_time.labels(*labels).observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None:
            self.decode_time.labels(*labels).observe(end - m.first_token_time)
            if num_generated > 1:
                self.request_tpot.labels(*labels).observe((end - m.first_token_time) / (num_generated - 1))
        self.request_prompt_tokens.labels(*labels).observe(num_prompt)
        self.request_generation_tokens.labels(*labels).observe(num_generated)
        self.request_prefill_kv_computed_tokens.labels(*labels).observe(num_prompt - num_cached)
        if m.max_tokens:
            self.request_params_max_tokens.labels(*labels).observe(m.max_tokens)
        self._observe_parent(labels, output.request_id, m.n, num_generated)

    def _count_prompt(self, labels: tuple[str, str], num_prompt: int, num_cached: int) -> None:
        self.prompt_tokens.labels(*labels).inc(num_prompt)
        self.prompt_tokens_cached.labels(*labels).inc(num_cached)
        self.prompt_tokens_by_source.labels(*labels, "local_compute").inc(num_prompt - num_cached)
        self.prompt_tokens_by_source.labels(*labels, "local_cache_hit").inc(num_cached)

    def _observe_parent(self, labels: tuple[str, str], request_id: str, n: int, num_generated: int) -> None:
        """`n` and the longest of the n sequences, once the request's last sequence finishes (as vLLM)."""
        if n > 1:
            with self._lock:
                entry = self._parents.setdefault(request_id, [n, 0])
                entry[0] -= 1
                entry[1] = max(entry[1], num_generated)
                if entry[0] > 0:
                    return
                del self._parents[request_id]
                num_generated = entry[1]
        self.request_params_n.labels(*labels).observe(n)
        self.request_max_num_generation_tokens.labels(*labels).observe(num_generated)

    def observe_embedding(self, model_name: str, stats: EmbeddingRequestStats) -> None:
        """A finished embedding request (`EmbeddingRequestStats`): each input counts as one request, as in vLLM,
        whose pooling requests finish with reason "stop" after their one forward (its prefill)."""
        labels = (model_name, ENGINE)
        for num_prompt in stats.num_prompt_tokens:
            self._count_prompt(labels, num_prompt, 0)
            self.request_success.labels(*labels, "stop").inc()
            self.e2e.labels(*labels).observe(stats.finished_time - stats.arrival_time)
            self.queue_time.labels(*labels).observe(stats.first_scheduled_time - stats.arrival_time)
            self.inference_time.labels(*labels).observe(stats.finished_time - stats.first_scheduled_time)
            self.prefill_time.labels(*labels).observe(stats.finished_time - stats.first_scheduled_time)
            self.request_prompt_tokens.labels(*labels).observe(num_prompt)
            self.request_prefill_kv_computed_tokens.labels(*labels).observe(num_prompt)
