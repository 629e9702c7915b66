"""Serving metrics from per-request timings, with `vllm bench serve`'s names.

TTFT: request sent -> first token. TPOT: (e2e - ttft) / (output tokens - 1). ITL: every gap between
successive streamed chunks. Goodput: completed requests per second that meet every SLO given.
"""

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0  # seconds since the benchmark began
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # seconds since the benchmark began

    @property
    def tpot(self) -> float | None:
        """None for one output token: no time per *output* token is defined then."""
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """SLOs in milliseconds: ttft, tpot, e2el."""
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2e}
    return all(values[name] * 1000 <= limit for name, limit in slos.items())


def _stats(prefix: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000 if values_s else np.zeros(1)
    out = {f"mean_{prefix}_ms": float(ms.mean()), f"median_{prefix}_ms": float(np.median(ms)),
           f"std_{prefix}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{prefix}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(results: list[RequestResult], duration: float, percentiles: list[float],
              slos: dict[str, float] | None = None) -> dict:
    done = [r for r in results if r.success]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    summary = {
        "duration": duration, "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": prompt, "total_output_tokens": output,
        "request_throughput": len(done) / duration, "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        "errors": sorted({r.error for r in results if not r.success}),
    }
    summary.update(_stats("ttft", [r.ttft for r in done], percentiles))
    summary.update(_stats("tpot", [r.tpot for r in done if r.tpot is not None], percentiles))
    summary.update(_stats("itl", [gap for r in done for gap in r.itl], percentiles))
    summary.update(_stats("e2el", [r.e2e for r in done], percentiles))
    if slos:
        good = sum(meets_slos(r, slos) for r in done)
        summary["request_goodput"] = good / duration
    return summary
