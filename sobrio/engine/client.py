"""The one seam between the server (and the gateway, agents) and an engine: the `EngineClient` protocol of a
generative model, the `EmbeddingClient` of an embedding model, and the typed `EngineStats` both report.

Implementations: `AsyncLLM` (the core in a thread of this process) and `AsyncMPClient` (the core in a process
of its own, the default of `sobrio serve`, with Ray placement behind it when asked), in `async_llm.py`;
`EmbeddingEngine` in `embedding.py`. `engine/launch.py` builds the right one from a config; nothing above
the seam builds one itself, reads an engine's attributes by name, or assigns hooks onto it: it registers
them (`subscribe`). Nothing here assumes the model lives in this process: requests go in as text or token
ids with sampling parameters, outputs come back as `RequestOutput`s.
"""

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from sobrio.config import SobrioConfig
from sobrio.engine.adapters import AdapterRegistry
from sobrio.engine.engine_stats import EmbeddingRequestStats, EngineStats, HistogramCounts
from sobrio.engine.outputs import RequestOutput
from sobrio.loader.lora import LoRARequest
from sobrio.types.params import SamplingParams

__all__ = ["AdapterRegistry", "EmbeddingClient", "EmbeddingRequestStats", "EngineClient", "EngineStats",
           "HistogramCounts", "Served", "Tokenizer"]

OnOutput = Callable[[RequestOutput, float], None]  # each output of each sequence, with its monotonic time
OnAbort = Callable[[str], None]  # a request id that will send no final output
OnFinished = Callable[[EmbeddingRequestStats], None]  # a finished embedding request


class Tokenizer(Protocol):
    """The front's text side: what the server asks of a model's tokenizer and chat template."""

    def tokenize(self, prompt: str | list[int] | None) -> list[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]: ...

    def decode(self, ids: list[int], param: str = "tokens") -> str: ...

    def token_strs(self, ids: list[int]) -> list[str]: ...

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template: str | None = None, template_kwargs: dict | None = None,
                        add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]: ...


@runtime_checkable
class EngineClient(Protocol):
    model_name: str
    task: Literal["generate"]
    healthy: bool  # False while the engine restarts: /health answers 503

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_num_waiting(self) -> int:
        """Admission bound of the waiting queue (sequences); past it requests get 429."""

    @property
    def config(self) -> SobrioConfig:
        """The engine's configuration (read by /metrics: cache_config_info)."""

    @property
    def input_processor(self) -> Tokenizer:
        """Chat templates, tokenization and the checks a request must pass (the front's)."""

    @property
    def chat_template(self) -> str | None:
        """The model's chat template (None: completions only)."""

    @property
    def default_sampling(self) -> dict:
        """--generation-config: SamplingParams keywords for the fields a request leaves unset (max_tokens too)."""

    @property
    def adapters(self) -> AdapterRegistry:
        """The LoRA adapters loaded on this model (empty unless --enable-lora)."""

    def with_adapter(self, lora: LoRARequest) -> "EngineClient":
        """This engine, every request through it run with one adapter (a request naming the adapter)."""

    def subscribe(self, on_output: OnOutput | None = None, on_abort: OnAbort | None = None) -> None:
        """Register observers (metrics, logs) on the delivery path; they never raise into it (the engine
        counts their errors in `EngineStats.callback_errors`)."""

    def generate(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                 prompt_token_ids: list[int] | None = None, cache_salt: str | None = None,
                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Outputs as the engine makes them (n sequences each); leaving early aborts the request."""

    async def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                          queue: asyncio.Queue, prompt_token_ids: list[int] | None = None,
                          cache_salt: str | None = None, priority: int = 0, kv_offload: bool | None = None) -> None:
        """Queue a request whose outputs go to `queue` (several requests may share one: n, prompt lists).
        `priority` (lower first) counts only under --scheduling-policy priority; otherwise it must be 0.
        `kv_offload`: whether its KV blocks may go to the offload tiers (None: the server's default)."""

    def stream_outputs(self, request_ids: list[str], n: int, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Every output of these requests from their shared queue; leaving early aborts the unfinished."""

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats:
        """Running, waiting, KV usage, prefix-cache counters, preemptions, and the per-request table sizes."""

    def purge_cache_salt(self, salt: str) -> None:
        """Forget the cached KV blocks of a salt (a deleted tenant) and shred its offloaded ones."""

    def shutdown(self, timeout: float = 5.0) -> None: ...


@runtime_checkable
class EmbeddingClient(Protocol):
    model_name: str
    task: Literal["embed"]
    healthy: bool  # False once the worker died: /health answers 503

    @property
    def max_model_len(self) -> int:
        """Most tokens one input may have (special tokens included)."""

    @property
    def dimensions(self) -> int: ...

    @property
    def max_num_waiting(self) -> int: ...

    @property
    def input_processor(self) -> Tokenizer:
        """Tokenizer and checks (`/tokenize` and `/detokenize` work on an embedding model too)."""

    def subscribe(self, on_finished: OnFinished | None = None) -> None:
        """Register an observer of finished requests (metrics); it never raises into the worker."""

    def tokenize_inputs(self, inputs: list[str | list[int]], truncate_prompt_tokens: int | None = None,
                        add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids per input (text or ids), checked; InvalidRequestError for bad or too long inputs. Blocking:
        call it in a worker thread."""

    async def embed(self, rows: list[list[int]], arrival_time: float | None = None) -> np.ndarray:
        """[rows, dimensions] float32 vectors, in row order; EngineOverloadedError when the queue is full.
        `arrival_time` (monotonic): when the request came, for /metrics (default: now)."""

    def stats(self) -> EngineStats:
        """The gauges and counters /metrics reads (zeros where meaningless: no KV cache)."""

    def shutdown(self, timeout: float = 5.0) -> None: ...


Served = EngineClient | EmbeddingClient  # a served model: `task` tells which
