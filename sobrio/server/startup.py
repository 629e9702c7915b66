"""What `sobrio serve` does before and around the app: the listening socket (bound before any model loads),
the names each model is served under, `--root-path`, and the periodic stats line (`--disable-log-stats`)."""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

from sobrio.config import ServerConfig
from sobrio.engine.outputs import RequestOutput
from sobrio.errors import ConfigError, SobrioError

if TYPE_CHECKING:
    from sobrio.engine.client import Served

logger = logging.getLogger("sobrio.server")

STATS_INTERVAL = 10.0  # seconds between stats lines, as vLLM's default


class StartupError(SobrioError):
    """The server cannot start (a busy port): `sobrio serve` exits 1 with this one line."""


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening address, bound now, so a busy port fails in a second rather than after the models load
    (uvicorn listens on this socket later; vLLM does the same). Nothing is accepted until then: a client gets
    "connection refused", not a hang."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    except socket.gaierror as exc:
        raise StartupError(f"cannot listen on {host}:{port}: unknown host ({exc.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = " (is another server running there? choose another --port)" if exc.errno == errno.EADDRINUSE else ""
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    return sock


def served_names(model_names: list[str], given: list[str] | None) -> list[list[str]]:
    """The names each model is served under: `--served-model-name` one per model in order (the rest keep
    their own), or every name for a single model (vLLM's `--served-model-name a b`). Names must be unique."""
    given = list(given or [])
    if len(model_names) == 1 and given:
        names = [given]
    elif len(given) > len(model_names):
        raise ConfigError(f"--served-model-name: {len(given)} names for {len(model_names)} models (one name per "
                          "model; a single model may take several)", "--served-model-name")
    else:
        names = [[given[i]] if i < len(given) else [own] for i, own in enumerate(model_names)]
    seen: set[str] = set()
    for name in (n for group in names for n in group):
        if name in seen:
            raise ConfigError(f"model name {name!r} is served twice; give each model its own "
                              "--served-model-name", "--served-model-name")
        seen.add(name)
    return names


def with_paths_as_given(models: list[str], names: list[list[str]], given: list[str] | None) -> list[list[str]]:
    """A folder or .gguf model served under its own name (its basename) also answers to the path as given on
    the command line (vLLM's name for it), unless --served-model-name named it or the path is taken."""
    taken = {n for group in names for n in group}
    named = len(given or [])
    for i, (model, group) in enumerate(zip(models, names)):
        if i >= named and model not in taken:
            group.append(model)
            taken.add(model)
    return names


class RootPath:
    """`--root-path /api`: a request under the prefix is routed as without it (`/api/v1/models` is
    `/v1/models`, with the ASGI `root_path` set); a request without it routes as before (vLLM's FastAPI
    `root_path` answers both). Outermost, so auth, limits and CORS see the path the routes see."""

    def __init__(self, app, root_path: str):
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            path = scope["path"]
            if path == self.root_path or path.startswith(self.root_path + "/"):
                scope = {**scope, "path": path[len(self.root_path):] or "/", "root_path": self.root_path}
        await self.app(scope, receive, send)


def listening_url(config: ServerConfig, sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if config.ssl_certfile else 'http'}://{host}:{port}{config.root_path or ''}"


class StatsLogger:
    """Every STATS_INTERVAL seconds while a model is busy, one line for it, as vLLM's: prompt and generation
    throughput, running and waiting requests, KV-cache use and prefix-cache hit rate since the last line."""

    def __init__(self, engines: dict[str, Served], interval: float = STATS_INTERVAL):
        self.engines = engines  # main name -> client
        self.interval = interval
        self.tokens = {name: [0, 0] for name in engines}  # name -> [prompt tokens, generated tokens]
        self._last = {name: (0, 0) for name in engines}  # prefix-cache (queries, hits) at the last line
        self._stop = threading.Event()
        for name, engine in engines.items():  # count tokens beside whatever else watches the outputs
            if engine.task == "generate":  # an embedding model: no tokens to count
                engine.subscribe(on_output=lambda output, t, name=name: self._observe(name, output))

    def _observe(self, name: str, output: RequestOutput) -> None:
        counts = self.tokens[name]
        counts[1] += len(output.delta_token_ids)
        first = output.outputs[0]
        if first.index == 0 and len(first.token_ids) == len(output.delta_token_ids) and first.token_ids:
            counts[0] += len(output.prompt_token_ids) - output.num_cached_tokens  # prompt computed: once

    def start(self) -> None:
        threading.Thread(target=self._run, name="stats-log", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            for name, engine in self.engines.items():
                self._log(name, engine, now - last)
            last = now

    def _log(self, name: str, engine: Served, elapsed: float) -> None:
        prompt, generated = self.tokens[name]
        self.tokens[name] = [0, 0]
        try:
            stats = engine.stats()
        except Exception:  # noqa: BLE001 - a restarting engine: no line this time
            return
        running, waiting = stats.num_requests_running, stats.num_requests_waiting
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        last_queries, last_hits = self._last[name]
        self._last[name] = (queries, hits)
        if not (prompt or generated or running or waiting):
            return  # idle: no line
        hit_rate = 100.0 * (hits - last_hits) / (queries - last_queries) if queries > last_queries else 0.0
        logger.info("model %s: prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, running %d, "
                    "waiting %d, KV cache %.1f%%, prefix cache hit rate %.1f%%", name, prompt / elapsed,
                    generated / elapsed, running, waiting, 100.0 * stats.kv_cache_usage_perc, hit_rate)
