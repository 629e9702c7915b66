"""What the engine hands back, shaped like vLLM's RequestOutput."""

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    n: int = 1  # sequences of the request (its `n`), for /metrics
    max_tokens: int | None = None  # the request's max_tokens, for /metrics
    energy_j: float = 0.0  # so far, its share of the engine steps it was in (engine/step_energy.py)
    energy_source: str | None = None  # "rapl" or "cpu-model"


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # Streaming: the text and tokens added since the previous output of the same sequence.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # prompt_logprobs (vLLM's): entry k for prompt token k (None for the first), with the top n
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # finish_reason "error" by the request's own fault (a grammar that failed to compile in time or at all):
    # what its client is told (HTTP 400); None for an engine failure (500)
    error: str | None = None
