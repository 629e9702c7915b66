"""The one place that builds engine clients from configs: what `sobrio serve` (and anything else that serves
models) calls, so no caller picks a client class, starts a process or connects to Ray itself.

- an embedding model: an `EmbeddingEngine` in this process (it loads in about a second);
- a generative model with `engine_process` (the default of `sobrio serve`): an `AsyncMPClient`, its core in a
  process of its own (data-parallel replicas, a prefill/decode pair, Ray placement behind it as configured);
- a generative model without: an `AsyncLLM`, its core stepped by a thread of this process.
"""

import functools
from collections.abc import Callable

from sobrio.config import ServerConfig, SobrioConfig
from sobrio.engine.client import EmbeddingClient, EngineClient, Served
from sobrio.loader.resolve import is_embedding_model
from sobrio.timing import start_together


def build_client(config: SobrioConfig, engine_process: bool = True,
                 max_restarts: int = ServerConfig.engine_restarts,
                 on_fatal: Callable[[], None] | None = None) -> Served:
    """One model's client. `on_fatal`: called when its core died more than `max_restarts` times."""
    return build_clients([config], engine_process, max_restarts, on_fatal)[0]


def build_clients(configs: list[SobrioConfig], engine_process: bool = True,
                  max_restarts: int = ServerConfig.engine_restarts,
                  on_fatal: Callable[[], None] | None = None) -> list[Served]:
    """Every model's client, in the configs' order; the generative cores start together. A failed start
    leaves nothing running."""
    embed = [is_embedding_model(c.model_config.model) for c in configs]
    embedders: list[EmbeddingClient] = []
    try:
        for config in (c for c, e in zip(configs, embed) if e):
            embedders.append(_embedding_client(config))
        generative = [c for c, e in zip(configs, embed) if not e]
        others = iter(_generative_clients(generative, engine_process, max_restarts, on_fatal) if generative else [])
    except BaseException:
        for client in embedders:
            client.shutdown()
        raise
    started = iter(embedders)
    return [next(started) if e else next(others) for e in embed]


def _embedding_client(config: SobrioConfig) -> EmbeddingClient:
    from sobrio.engine.embedding import EmbeddingEngine

    return EmbeddingEngine.from_config(config)


def _generative_clients(configs: list[SobrioConfig], engine_process: bool, max_restarts: int,
                        on_fatal: Callable[[], None] | None) -> list[EngineClient]:
    """One client per model, each core in a process of its own (started together), or in this process."""
    from sobrio.engine.async_llm import AsyncLLM, AsyncMPClient

    if not engine_process:
        return [AsyncLLM.from_config(c) for c in configs]
    if any(c.parallel_config.distributed_executor_backend == "ray" for c in configs):
        from sobrio.engine.ray_workers import connect_ray

        connect_ray()  # from this thread: Ray's local processes die with the thread that started them
    starters = [functools.partial(AsyncMPClient, c, max_restarts, on_fatal=on_fatal) for c in configs]
    return start_together(starters, lambda client: client.shutdown())
