"""EngineClient: the one protocol the server (and later the gateway, agents, bench) uses to reach an engine.

Implementations: `AsyncLLM` (the core in a thread of this process) and `AsyncMPClient` (the core in a
process of its own, the default of `sobrio serve`), both in `async_llm.py`. A remote OpenAI-compatible
backend is the third, for the gateway. Nothing here assumes the model lives in this process: requests go
in as text or token ids with sampling parameters, outputs come back as `RequestOutput`s.
"""

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from sobrio.config import SobrioConfig
from sobrio.engine.input import InputProcessor
from sobrio.engine.outputs import RequestOutput
from sobrio.types.params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    model_name: str
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
    def input_processor(self) -> InputProcessor:
        """Chat templates, tokenization and the checks a request must pass (the front's)."""

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

    def stats(self) -> dict:
        """Running, waiting, KV usage, prefix-cache counters, preemptions, and the per-request table sizes."""

    def shutdown(self, timeout: float = 5.0) -> None: ...
