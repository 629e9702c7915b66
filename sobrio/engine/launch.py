"""The one place that builds engine clients from configs: what `sobrio serve` (and anything else that serves
models) calls, so no caller picks a client class, starts a process or connects to Ray itself.

- an embedding model: an `EmbeddingEngine` in this process (it loads in about a second);
- a generative model with `engine_process` (the default of `sobrio serve`): an `AsyncMPClient`, its core in a
  process of its own (data-parallel replicas, a prefill/decode pair, Ray placement behind it as configured);
- a generative model without: an `AsyncLLM`, its core stepped by a thread of this process.

Light to import (no torch, no transformers at its top): `start_cores` starts the plain engine-core processes
first, so they load while the server imports the rest and reads the tokenizers; `build_clients` then takes them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from sobrio.config import ServerConfig, SobrioConfig
from sobrio.loader.resolve import core_may_start_first, is_embedding_model
from sobrio.timing import start_together

if TYPE_CHECKING:
    from sobrio.engine.client import EmbeddingClient, EngineClient, Served
    from sobrio.engine.core_process import CoreProcess


def start_cores(configs: list[SobrioConfig], engine_process: bool = True) -> list[CoreProcess | None]:
    """Each model's engine-core process started, not waited for, where its core is one plain child process
    (not an embedding model, data-parallel replicas, a prefill/decode pair, Ray, or a GGUF to prepare first);
    None for the others. `build_clients` takes them over; until then a caller that fails closes them
    (`close_cores`)."""
    from sobrio.engine.core_process import CoreProcess

    started: list[CoreProcess | None] = []
    try:
        for config in configs:
            plain = engine_process and not is_embedding_model(config.model_config.model) \
                and config.parallel_config.distributed_executor_backend != "ray" \
                and config.parallel_config.data_parallel_size == 1 and not config.kv_transfer_config.enabled
            mc = config.model_config
            started.append(CoreProcess(config, wait=False) if plain and core_may_start_first(mc.model, mc.quantization)
                           else None)
        import sobrio.engine.async_llm  # noqa: F401  (the clients' modules, torch with them, while the cores load)
    except BaseException:
        close_cores(started)
        raise
    return started


def close_cores(started: list[CoreProcess | None]) -> None:
    """Stop the cores `start_cores` started (a start that failed before `build_clients` took them)."""
    for core in started:
        if core is not None:
            core.close(timeout=1)


def build_client(config: SobrioConfig, engine_process: bool = True,
                 max_restarts: int = ServerConfig.engine_restarts,
                 on_fatal: Callable[[], None] | None = None) -> Served:
    """One model's client. `on_fatal`: called when its core died more than `max_restarts` times."""
    return build_clients([config], engine_process, max_restarts, on_fatal)[0]


def build_clients(configs: list[SobrioConfig], engine_process: bool = True,
                  max_restarts: int = ServerConfig.engine_restarts,
                  on_fatal: Callable[[], None] | None = None,
                  started: list[CoreProcess | None] | None = None) -> list[Served]:
    """Every model's client, in the configs' order; the generative cores start together (`started`: the
    cores `start_cores` started for these configs, which the clients take over). A failed start leaves
    nothing running."""
    embed = [is_embedding_model(c.model_config.model) for c in configs]
    started = started or [None] * len(configs)
    embedders: list[EmbeddingClient] = []
    try:
        for config in (c for c, e in zip(configs, embed) if e):
            embedders.append(_embedding_client(config))
        generative = [(c, s) for c, e, s in zip(configs, embed, started) if not e]
        others = iter(_generative_clients(generative, engine_process, max_restarts, on_fatal) if generative else [])
    except BaseException:
        for client in embedders:
            client.shutdown()
        close_cores(started)  # those no client took (closing one twice does nothing)
        raise
    started = iter(embedders)
    return [next(started) if e else next(others) for e in embed]


def _embedding_client(config: SobrioConfig) -> EmbeddingClient:
    from sobrio.engine.embedding import EmbeddingEngine

    return EmbeddingEngine.from_config(config)


def _generative_clients(configs: list[tuple[SobrioConfig, CoreProcess | None]], engine_process: bool,
                        max_restarts: int, on_fatal: Callable[[], None] | None) -> list[EngineClient]:
    """One client per model, each core in a process of its own (started together, or already), or in this
    process."""
    from sobrio.engine.async_llm import AsyncLLM, AsyncMPClient

    if not engine_process:
        return [AsyncLLM.from_config(c) for c, _ in configs]
    if any(c.parallel_config.distributed_executor_backend == "ray" for c, _ in configs):
        from sobrio.engine.ray_workers import connect_ray

        connect_ray()  # from this thread: Ray's local processes die with the thread that started them
    starters = [functools.partial(AsyncMPClient, c, max_restarts, on_fatal=on_fatal, started=s) for c, s in configs]
    return start_together(starters, lambda client: client.shutdown())
