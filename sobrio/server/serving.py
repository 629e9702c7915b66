"""`sobrio serve`: check the flags and models, bind the port, start the engine cores, build the engine clients
(engine/launch.py), open the gateway (tenants, ledger, router, remote backends), then serve with uvicorn until
a signal; a graceful shutdown drains, then ends what is still in flight with an OpenAI error.

The engine-core processes start before this process imports torch, the app (FastAPI, the gateway) and the
tokenizers: the module imports neither at its top, so both processes load at once (`launch.start_cores`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

from sobrio import collector
from sobrio.config import ServerConfig, SobrioConfig
from sobrio.engine.launch import build_clients, close_cores, start_cores
from sobrio.engine_args import add_config_args, add_engine_args, config_from_args, engine_kwargs
from sobrio.errors import ConfigError, SobrioError
from sobrio.gateway.carbon import region_code
from sobrio.gateway.config import GatewayConfig, load_gateway_config
from sobrio.loader.resolve import ALIASES, DEFAULT_MODELS, check_model_name, is_installed, resolve_model
from sobrio.server.startup import RootPath, StatsLogger, bind_socket, listening_url, served_names, with_paths_as_given
from sobrio.timing import log_step

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from sobrio.engine.client import Served
    from sobrio.server.app import OpenAIServer

logger = logging.getLogger("sobrio.server")


def add_serve_parser(sub, extra_routes: tuple = ()) -> None:
    """`sobrio serve [MODEL]`: ServerConfig's flags (with nested limits and CORS), then every engine concern's,
    then the vLLM flags sobrio refuses; the help ends with the environment variables sobrio reads.
    `extra_routes`: the routes of the layers above the server (the agents'), added to its app."""
    from sobrio.engine_args import ENVIRONMENT, HelpFormatter

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (as `vllm serve`)",
                           description="Serve models over an OpenAI-compatible HTTP API. The flags are vLLM's; "
                                       "MODEL and --model may be combined (MODEL is served first).",
                           epilog=ENVIRONMENT, formatter_class=HelpFormatter)
    add_config_args(serve, ServerConfig)
    add_engine_args(serve, with_model=False)
    serve.set_defaults(func=functools.partial(run_server, extra_routes=extra_routes))


@dataclasses.dataclass
class ServePlan:
    """What `sobrio serve` decided from its flags before anything loads."""

    config: ServerConfig
    gateway: GatewayConfig
    models: list[str]  # as given: aliases, folders, files
    names: list[list[str]]  # each model's served names, its main name first
    configs: list[SobrioConfig]
    region: str


def plan_serving(args) -> ServePlan:
    """Flags, configuration file and models checked; an error a user can fix raises (exit 2)."""
    config = config_from_args(args, ServerConfig)
    _configure_logging(config.log_level)
    gateway = load_gateway_config(config.config)
    models = _served_models(config, gateway)
    region = region_code(config.region)  # an unknown one fails now, before anything loads
    names = with_paths_as_given(models, served_names([m if m in ALIASES else resolve_model(m).name for m in models],
                                                     config.served_model_name), config.served_model_name)
    configs = [SobrioConfig.from_kwargs(model=model, **engine_kwargs(args)) for model in models]
    return ServePlan(config, gateway, models, names, configs, region)


def run_server(args, extra_routes: tuple = ()) -> int:
    """Check the flags and models, bind the port, load every model, then serve; each step logged with its
    timing. Errors a user can fix raise (the CLI prints one line and exits 2, or 1 for a busy port)."""
    with collector.paused():  # the start's objects are not garbage: no collection walks them (sobrio/collector.py)
        started = _start_server(args, extra_routes)
    if isinstance(started, int):
        return started
    server, sock, fatal = started
    server.run(sockets=[sock])
    return 1 if fatal.is_set() else 0


def _start_server(args, extra_routes: tuple) -> tuple[uvicorn.Server, socket.socket, threading.Event] | int:
    """The server ready to run on its bound socket, with the event set by an engine core that keeps dying; or
    the exit code of a start that failed."""
    started = time.monotonic()
    plan = plan_serving(args)
    config = plan.config
    sock = bind_socket(config.host, config.port)  # a busy port fails now, not after loading
    fatal = threading.Event()  # an engine core that keeps dying: exit non-zero for a supervisor
    try:
        clients = _start_local_models(config, plan.models, plan.configs, fatal.set)
    except ConfigError:
        sock.close()
        raise  # a flag the model refuses (--quantization awq on a float checkpoint): exit 2, as a bad flag does
    except SobrioError as exc:
        sock.close()
        logger.error("%s", exc)
        return 1
    from sobrio.server.edge import edge_stack

    engines = {group[0]: client for group, client in zip(plan.names, clients)}
    app = build_app(plan, engines, sock, extra_routes)
    asgi, limits_layer = edge_stack(app, config.api_key, config.limits, config.cors, app.state.server.gateway.store,
                                    app.state.server.gateway.ledger, plan.region, config.metrics_require_key)
    if config.root_path:
        asgi = RootPath(asgi, config.root_path)
    stats = None if config.disable_log_stats else StatsLogger(engines)
    _add_lifespan(app, app.state.server, stats, _listening_line(plan, sock, app.state.server, started))
    server = _uvicorn_server(config, asgi, list(engines.values()))
    limits_layer.count_connections = lambda: len(server.server_state.connections)
    threading.Thread(target=_exit_on_fatal, args=(fatal, server), daemon=True).start()
    return server, sock, fatal


def build_app(plan: ServePlan, engines: dict[str, Served], sock: socket.socket, extra_routes: tuple) -> FastAPI:
    """The app over the started engines, with its gateway opened: remote backends, router, tenants, ledger."""
    from sobrio.server.app import create_app
    from sobrio.server.lora_routes import adapter_names

    config = plan.config
    app = create_app(engines, config.limits, config.default_max_tokens, config.metrics_prefix, plan.region,
                     extra_routes)
    server: OpenAIServer = app.state.server
    server.aliases = {alias: group[0] for group in plan.names for alias in group[1:]}
    server.log_requests = not config.disable_log_requests
    server.gateway.add_remotes(plan.gateway)
    # an adapter may be one of the router's two models (its base the other): the adapters of --lora-modules
    server.gateway.start_router(config, plan.gateway, server.model_names() + adapter_names(server.engines))
    server.gateway.open_tenants(config.db, plan.gateway, config.api_key)
    scheme, port = "https" if config.ssl_certfile else "http", sock.getsockname()[1]
    server.self_url = f"{scheme}://127.0.0.1:{port}{config.root_path or ''}"  # loopback, whatever --host
    server.agent_skills = config.agent_skills
    return app


def _listening_line(plan: ServePlan, sock: socket.socket, server: OpenAIServer, started: float):
    """The log line that says the server is up: where, what it serves, how long start-up took."""
    url = listening_url(plan.config, sock)

    def log() -> None:
        remote = [f"{m.model} ({len(m.replicas)} replica(s))" for m in server.gateway.backends.models.values()
                  if any(r.is_remote for r in m.replicas)]
        logger.info("listening on %s: %s (start-up took %.1fs)", url, ", ".join(
            [" = ".join(group) for group in plan.names] + remote), time.monotonic() - started)

    return log


def _add_lifespan(app: FastAPI, server: OpenAIServer, stats: StatsLogger | None, listening) -> None:
    """Start-up: the listening line, the stats log, the gateway's background work (a deleted tenant's cached
    blocks purged from every engine). Shutdown: all of it stopped, then the engines."""
    generative = [e for e in server.engines.values() if e.task == "generate"]

    @app.on_event("startup")
    async def _start():
        listening()
        if stats is not None:
            stats.start()
        server.gateway.start(lambda salt: [e.purge_cache_salt(salt) for e in generative])

    @app.on_event("shutdown")
    async def _stop():
        await server.gateway.stop()
        if stats is not None:
            stats.stop()
        for engine in server.engines.values():
            engine.shutdown()


def _configure_logging(level_name: str) -> None:
    from uvicorn.logging import TRACE_LOG_LEVEL

    logging.addLevelName(TRACE_LOG_LEVEL, "TRACE")  # uvicorn's; unknown to logging until registered
    level = TRACE_LOG_LEVEL if level_name == "trace" else level_name.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("httpx", "httpcore"):  # a line per call to a remote backend; headers at debug
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger(chatty).level))


def _served_models(config: ServerConfig, gateway: GatewayConfig | None = None) -> list[str]:
    """MODEL, then --model, then the configuration file's local models; with none of those and no remote
    one, every installed default alias. Each checked now (an unknown one is a one-line error listing the
    aliases, before anything loads). A gateway of remote backends only loads none."""
    gateway = gateway or GatewayConfig()
    models = [m for m in [config.model_tag, *(config.model or []), *gateway.local_models] if m]
    if gateway.models:
        return list(dict.fromkeys(models))
    models = models or [m for m in DEFAULT_MODELS if is_installed(m)]
    if not models:
        raise ConfigError("no model to serve: name one (sobrio serve MODEL), or install an alias (sobrio models)")
    for model in models:
        check_model_name(model)
    return models


def _start_local_models(config: ServerConfig, models: list[str], configs: list[SobrioConfig], on_fatal) -> list:
    """The local models' clients (engine/launch.py); none for a gateway of remote backends only."""
    if not models:
        logger.info("no local model: every model is served by remote backends")
        return []
    with log_step(logger, "starting %d model(s): %s", len(models), ", ".join(models)):
        cores = start_cores(configs, config.engine_process)  # they load while this process imports and reads
        try:
            _import_server()
        except BaseException:
            close_cores(cores)
            raise
        return build_clients(configs, config.engine_process, config.engine_restarts, on_fatal, started=cores)


def _import_server() -> None:
    """The app's modules (FastAPI, pydantic, the gateway), imported while the engine cores load: each is
    needed once they are ready."""
    import sobrio.server.app  # noqa: F401
    import sobrio.server.edge  # noqa: F401


def _uvicorn_server(config: ServerConfig, asgi, engines: list[Served]):
    """uvicorn with our h11 protocol (header and discard deadlines), no access log (HttpEdge logs, without
    queries), TLS when given a key and certificate, and a graceful shutdown whose own deadline is a backstop
    a little after ours: by then every request has had its error answer."""
    import uvicorn

    from sobrio.server.limits import protocol_class as guarded_protocol_class

    uvicorn_level = config.uvicorn_log_level or config.log_level
    uvicorn_config = uvicorn.Config(asgi, host=config.host, port=config.port, log_level=uvicorn_level,
                                    lifespan="on", http=guarded_protocol_class(config.limits), access_log=False,
                                    timeout_graceful_shutdown=config.shutdown_timeout + 5,
                                    ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
                                    ssl_ca_certs=config.ssl_ca_certs, ssl_cert_reqs=config.ssl_cert_reqs)
    # uvicorn.asgi at trace would log each request's scope, query string included: kept at debug at most.
    logging.getLogger("uvicorn.asgi").setLevel(max(logging.DEBUG, logging.getLogger("uvicorn.asgi").level))
    return _graceful_server_class()(uvicorn_config, engines, config.shutdown_timeout)


def _exit_on_fatal(fatal: threading.Event, server) -> None:
    fatal.wait()
    logger.error("an engine core could not be kept running; stopping the server (exit status 1)")
    server.should_exit = True


def _graceful_server_class():
    import uvicorn

    class _GracefulServer(uvicorn.Server):
        """Drains for `drain_timeout` seconds after SIGTERM, then stops the engines: each request still in flight
        gets an OpenAI error (a stream: an error event and `[DONE]`) before its connection closes. uvicorn
        re-raises SIGTERM after draining, so the process dies with status -15; we exit 0 instead."""

        def __init__(self, config, engines: list[Served], drain_timeout: float):
            super().__init__(config)
            self.engines = engines
            self.drain_timeout = drain_timeout

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

        async def shutdown(self, sockets=None) -> None:
            deadline = asyncio.ensure_future(self._stop_engines_after(self.drain_timeout))
            try:
                await super().shutdown(sockets)
            finally:
                deadline.cancel()

        async def _stop_engines_after(self, delay: float) -> None:
            await asyncio.sleep(delay)
            logger.info("shutdown deadline (%gs) passed: ending the requests still in flight", delay)
            for engine in self.engines:
                await asyncio.to_thread(engine.shutdown)

    return _GracefulServer
