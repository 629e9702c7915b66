"""Prometheus metrics, `sobrio:` + vLLM's names, labelled by model_name. Never any request text."""

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sobrio.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class EngineStatsCollector:
    """Reads the engines' live state at scrape time (gauges and the cache/preemption counters)."""

    def __init__(self, engines: dict, own_tables=lambda: {}):
        self.engines = engines
        self.own_tables = own_tables  # the server's per-request tables, counted beside the engines'

    def collect(self):
        gauges = {name: GaugeMetricFamily(f"sobrio:{name}", doc, labels=["model_name"]) for name, doc in [
            ("num_requests_running", "Requests in the running batch"),
            ("num_requests_waiting", "Requests waiting to be scheduled"),
            ("kv_cache_usage_perc", "Share of KV cache blocks in use (1 = full)")]}
        counters = {name: CounterMetricFamily(f"sobrio:{name}", doc, labels=["model_name"]) for name, doc in [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
            ("num_preemptions", "Requests preempted for lack of KV blocks")]}
        tables = GaugeMetricFamily("sobrio:request_table_entries", "Entries of each per-request table (a "
                                   "request that left one behind shows here once idle)", labels=["model_name", "table"])
        for model_name, engine in self.engines.items():
            stats = engine.stats()
            for name, family in {**gauges, **counters}.items():
                family.add_metric([model_name], stats[name])
            for table, size in {**stats["tables"], **self.own_tables()}.items():
                tables.add_metric([model_name, table], size)
        yield from gauges.values()
        yield from counters.values()
        yield tables


class ServerMetrics:
    def __init__(self, engines: dict):
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(engines, self.table_sizes))
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("sobrio:prompt_tokens", "Prefill tokens processed", labels, registry=r)
        self.generation_tokens = Counter("sobrio:generation_tokens", "Tokens generated", labels, registry=r)
        self.request_success = Counter("sobrio:request_success", "Finished requests", labels + ["finished_reason"],
                                       registry=r)
        hist = lambda name, doc: Histogram(f"sobrio:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token")
        self.itl = hist("inter_token_latency_seconds", "Time between successive output tokens")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first schedule")
        self._last_token_time: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()  # observe runs on engine threads, forget on those or the event loop

    def table_sizes(self) -> dict[str, int]:
        return {"metrics_inter_token": len(self._last_token_time)}

    def forget(self, request_id: str) -> None:
        """An aborted request sends no final output: drop its inter-token bookkeeping."""
        with self._lock:
            for key in [k for k in self._last_token_time if k[0] == request_id]:
                del self._last_token_time[key]

    def observe(self, model_name: str, output: RequestOutput, now: float) -> None:
        """Called by the engine thread for each output of each sequence."""
        key = (output.request_id, output.outputs[0].index)
        with self._lock:
            last = self._last_token_time.get(key)
            self._last_token_time[key] = now
            if output.finished:
                self._last_token_time.pop(key, None)
        new_tokens = len(output.delta_token_ids)
        if last is None:
            self.ttft.labels(model_name).observe(now - output.metrics.arrival_time)
        elif new_tokens:
            self.itl.labels(model_name).observe((now - last) / new_tokens)
        self.generation_tokens.labels(model_name).inc(new_tokens)
        if not output.finished:
            return
        m = output.metrics
        if output.outputs[0].index == 0:
            self.prompt_tokens.labels(model_name).inc(len(output.prompt_token_ids))
        self.request_success.labels(model_name, output.outputs[0].finish_reason).inc()
        self.e2e.labels(model_name).observe(now - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.labels(model_name).observe(m.first_scheduled_time - m.arrival_time)
