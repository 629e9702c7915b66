"""`sobrio serve`: the OpenAI-compatible HTTP API over one EngineClient per served model."""

import asyncio
import dataclasses
import json
import logging
import threading
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import sobrio
from sobrio.config import LimitsConfig, ServerConfig, SobrioConfig
from sobrio.engine.async_llm import AsyncLLM, EngineStepError
from sobrio.engine.client import EngineClient
from sobrio.engine.outputs import RequestOutput
from sobrio.engine_args import add_config_args, add_engine_args, config_from_args, engine_kwargs
from sobrio.errors import ConfigError, EngineOverloadedError, InvalidRequestError, SobrioError, UnknownModelError
from sobrio.loader.resolve import DEFAULT_MODELS, is_installed
from sobrio.sample.params import SamplingParams
from sobrio.server.edge import edge_stack, install_openapi
from sobrio.server.errors import error_response, log_unexpected
from sobrio.server.limits import check_fanout, check_prompt_tokens
from sobrio.server.limits import protocol_class as guarded_protocol_class
from sobrio.server.metrics import ServerMetrics
from sobrio.server.protocol import ChatCompletionRequest, CompletionRequest, new_id, now
from sobrio.server.responses import ChoiceState, chat_chunk, completion_chunk, final_response, usage_of

logger = logging.getLogger("sobrio.server")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A message naming the field, never echoing the value sent."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    if first.get("type") == "extra_forbidden":
        return f"unsupported field {'.'.join(loc)!r}: sobrio does not implement it", param
    where = ".".join(loc) or "body"
    return f"invalid value for {where!r}: {first.get('msg', 'invalid')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(SobrioError)
    async def _sobrio(_, exc: SobrioError):
        return sobrio_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):  # 404 unknown path, 405 wrong method: OpenAI bodies too
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_, exc: Exception):
        # Starlette's ServerErrorMiddleware answers with this, then re-raises: HttpEdge logs the type and place.
        return error_response(500, "internal server error", "server_error")


def sobrio_error_response(exc: Exception) -> JSONResponse:
    if isinstance(exc, InvalidRequestError):
        return error_response(400, str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, UnknownModelError):
        return error_response(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, EngineOverloadedError):
        return error_response(429, str(exc), "rate_limit_error", headers={"Retry-After": "1"})
    if isinstance(exc, EngineStepError):
        return error_response(500, str(exc), "server_error")
    return error_response(503, str(exc), "server_error")


class OpenAIServer:
    def __init__(self, engines: dict[str, EngineClient], limits: LimitsConfig | None = None,
                 default_max_tokens: int | None = ServerConfig.default_max_tokens):
        assert engines, "at least one model must be served"
        self.engines = engines
        self.limits = limits or LimitsConfig()
        self.default_max_tokens = default_max_tokens or None  # 0: up to the context
        self.metrics = ServerMetrics(engines)
        for name, engine in engines.items():
            engine.on_output = lambda output, t, name=name: self._on_output(name, output, t)
            engine.on_abort = self.metrics.forget

    def _on_output(self, model_name: str, output: RequestOutput, t: float) -> None:
        self.metrics.observe(model_name, output, t)
        if output.finished:
            m, c = output.metrics, output.outputs[0]
            ttft = (m.first_token_time or t) - m.arrival_time
            logger.info("request %s seq %d model=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d "
                        "ttft=%.3fs e2e=%.3fs finish=%s", output.request_id, c.index, model_name,
                        len(output.prompt_token_ids), output.num_cached_tokens, len(c.token_ids), ttft,
                        t - m.arrival_time, c.finish_reason)

    def engine_for(self, model: str | None) -> tuple[str, EngineClient]:
        if model is None or model == "":
            name = next(iter(self.engines))
            return name, self.engines[name]
        if model not in self.engines:
            raise UnknownModelError(f"model {model!r} is not served here; served: {', '.join(self.engines)}")
        return model, self.engines[model]

    def check_fanout(self, engine: EngineClient, num_prompts: int, n: int) -> None:
        """Prompts and sequences against the limits and the waiting queue, before any tokenizing."""
        waiting = engine.stats()["num_requests_waiting"]
        check_fanout(self.limits, num_prompts, n, waiting, engine.max_num_waiting)

    def params_for(self, params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """A request without max_tokens gets the server's default, capped at what the context leaves (vLLM caps
        at the context); a prompt that leaves nothing is refused by the engine with its own message."""
        room = max_model_len - num_prompt_tokens
        if params.max_tokens is not None or self.default_max_tokens is None or room <= 0:
            return params
        return dataclasses.replace(params, max_tokens=min(self.default_max_tokens, room))

    async def submit(self, engine: EngineClient, base_id: str, prompts: list[list[int]], params: list[SamplingParams],
                     cache_salt, queue) -> list[str]:
        """Add one engine request per prompt; on any failure abort those already added and re-raise."""
        ids: list[str] = []
        try:
            for i, (prompt_ids, prompt_params) in enumerate(zip(prompts, params, strict=True)):
                request_id = f"{base_id}-{i}"
                await engine.add_request(request_id, None, prompt_params, queue, prompt_token_ids=prompt_ids,
                                         cache_salt=cache_salt)
                ids.append(request_id)
        except BaseException:
            for request_id in ids:
                engine.abort(request_id)
            raise
        return ids


def create_app(engines: dict[str, EngineClient], limits: LimitsConfig | None = None,
               default_max_tokens: int | None = ServerConfig.default_max_tokens) -> FastAPI:
    """The API itself; `edge_stack` wraps it with auth, CORS, limits, request ids and the access log."""
    server = OpenAIServer(engines, limits, default_max_tokens)
    app = FastAPI(title="sobrio", version=sobrio.__version__)
    app.state.server = server
    install_error_handlers(app)
    install_openapi(app)

    @app.get("/health")
    async def health():
        down = [name for name, engine in server.engines.items() if not engine.healthy]
        if down:  # an engine core died and is restarting: a probe must see it
            return error_response(503, f"engine unavailable: {', '.join(down)}", "server_error")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": sobrio.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        data = [{"id": name, "object": "model", "created": now(), "owned_by": "sobrio",
                 "max_model_len": engine.max_model_len} for name, engine in server.engines.items()]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        name, engine = server.engine_for(body.model)
        params = body.to_sampling_params()
        server.check_fanout(engine, 1, params.n)
        try:
            messages = [m.template_dict() for m in body.messages]
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="messages") from None
        ids = await asyncio.to_thread(engine.input_processor.chat_prompt_ids, messages,
                                      body.add_generation_prompt)
        return await _respond(server, request, body, params, name, engine, [ids], "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        name, engine = server.engine_for(body.model)
        params = body.to_sampling_params()
        prompts = body.prompts()
        server.check_fanout(engine, len(prompts), params.n)
        tokenize = engine.input_processor.tokenize
        ids = await asyncio.to_thread(lambda: [tokenize(p) for p in prompts])
        return await _respond(server, request, body, params, name, engine, ids, "completion")

    return app


async def _respond(server: OpenAIServer, request: Request, body, params: SamplingParams, model_name: str,
                   engine: EngineClient, prompts: list[list[int]], kind: str):
    check_prompt_tokens(server.limits, [len(p) for p in prompts], params.n)
    max_model_len = engine.max_model_len
    per_prompt = [server.params_for(params, len(p), max_model_len) for p in prompts]
    base_id = new_id("chatcmpl" if kind == "chat" else "cmpl")
    request.state.request_id = base_id  # X-Request-Id of the answer, unless the client sent its own
    queue: asyncio.Queue = asyncio.Queue()
    request_ids = await server.submit(engine, base_id, prompts, per_prompt, body.cache_salt, queue)
    stream = engine.stream_outputs(request_ids, params.n, queue)
    choices = ChoiceState(request_ids, params.n, params.logprobs)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        sse = _sse(stream, choices, base_id, model_name, kind, include_usage)
        return StreamingResponse(sse, media_type="text/event-stream")
    try:
        outputs = await _collect_unless_disconnected(stream, request)
    except EngineStepError as exc:
        return sobrio_error_response(exc)
    if outputs is None:
        return Response(status_code=499)
    for output in outputs:
        choices.add(output)
    return final_response(choices, base_id, model_name, kind)


async def _collect_unless_disconnected(stream: AsyncIterator[RequestOutput], request: Request):
    """Gather a non-streamed request's outputs; if the client goes away first, abort it (None).

    The disconnect is ASGI's `http.disconnect`, awaited as it comes (no polling), so the abort reaches the
    engine before its next step. (Polling `request.is_disconnected()` under Starlette's BaseHTTPMiddleware
    never saw it: that middleware's receive wrapper loses the message in a cancelled scope.)"""
    collect = asyncio.ensure_future(_collect(stream))
    gone = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait([collect, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collect, gone):
            if not task.done():
                task.cancel()
        await asyncio.gather(collect, gone, return_exceptions=True)
        await stream.aclose()  # aborts whatever is unfinished
    return None if collect.cancelled() else collect.result()


async def _collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [o async for o in stream]


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _sse(stream: AsyncIterator[RequestOutput], choices: ChoiceState, base_id: str, model_name: str,
               kind: str, include_usage: bool) -> AsyncIterator[str]:
    """The stream's chunks; a failure (the engine's, a shutdown's, or a bug) ends it with an OpenAI error
    event and then `[DONE]`, so a client can tell a cut from a finished answer."""
    created = now()
    make_chunk = chat_chunk if kind == "chat" else completion_chunk
    try:
        async for output in stream:
            choice = choices.add(output)
            chunk = make_chunk(choices, choice, output, base_id, model_name, created)
            if include_usage:
                chunk["usage"] = None
            yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage:
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            final = {"id": base_id, "object": obj, "created": created, "model": model_name, "choices": [],
                     "usage": usage_of(choices).model_dump()}
            yield f"data: {json.dumps(final)}\n\n"
    except SobrioError as exc:
        yield f"data: {json.dumps(json.loads(sobrio_error_response(exc).body))}\n\n"
    except Exception as exc:  # noqa: BLE001 - a bug mid-stream: say so in the stream, log no message
        log_unexpected(exc, "stream")
        yield f"data: {json.dumps(json.loads(error_response(500, 'internal server error', 'server_error').body))}\n\n"
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"


def add_serve_parser(sub) -> None:
    """`sobrio serve`: ServerConfig's flags (with nested limits and CORS), then every engine concern's."""
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_config_args(serve, ServerConfig)
    add_engine_args(serve, with_model=False)
    serve.set_defaults(func=run_server)


def _configure_logging(level_name: str) -> None:
    from uvicorn.logging import TRACE_LOG_LEVEL

    logging.addLevelName(TRACE_LOG_LEVEL, "TRACE")  # uvicorn's; unknown to logging until registered
    level = TRACE_LOG_LEVEL if level_name == "trace" else level_name.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _served_models(config: ServerConfig) -> list[str]:
    """--model, or every installed default alias; more --served-model-name than models is a ConfigError."""
    models = config.model or [m for m in DEFAULT_MODELS if is_installed(m)]
    if len(config.served_model_name or []) > len(models):
        raise ConfigError(f"--served-model-name must be given at most once per model served ({len(models)})",
                          "--served-model-name")
    return models


def _served_names(config: ServerConfig, models: list[str], clients: list[EngineClient]) -> dict[str, EngineClient]:
    """Each engine under its --served-model-name, else its alias, else the model's own name."""
    names = list(config.served_model_name or [])
    engines = {}
    for i, (model, engine) in enumerate(zip(models, clients)):
        engines[names[i] if i < len(names) else (model if model in DEFAULT_MODELS else engine.model_name)] = engine
    return engines


def run_server(args) -> int:
    config = config_from_args(args, ServerConfig)
    _configure_logging(config.log_level)
    models = _served_models(config)
    configs = [SobrioConfig.from_kwargs(model=model, **engine_kwargs(args)) for model in models]
    fatal = threading.Event()  # an engine core that keeps dying: exit non-zero for a supervisor
    try:
        clients = _start_engines(configs, config.engine_process, config.engine_restarts, fatal.set)
    except SobrioError as exc:
        logger.error("%s", exc)
        return 1
    engines = _served_names(config, models, clients)
    app = create_app(engines, config.limits, config.default_max_tokens)
    asgi, limits_layer = edge_stack(app, config.api_key, config.limits, config.cors)

    @app.on_event("shutdown")
    async def _stop_engines():
        for engine in engines.values():
            engine.shutdown()

    logger.info("serving %s on http://%s:%d", ", ".join(engines), config.host, config.port)
    server = _uvicorn_server(config, asgi, list(engines.values()))
    limits_layer.count_connections = lambda: len(server.server_state.connections)
    threading.Thread(target=_exit_on_fatal, args=(fatal, server), daemon=True).start()
    server.run()
    return 1 if fatal.is_set() else 0


def _uvicorn_server(config: ServerConfig, asgi, engines: list[EngineClient]):
    """uvicorn with our h11 protocol (header and discard deadlines), no access log (HttpEdge logs, without
    queries), and a graceful shutdown whose own deadline is a backstop a little after ours: by then every
    request has had its error answer."""
    import uvicorn

    uvicorn_config = uvicorn.Config(asgi, host=config.host, port=config.port, log_level=config.log_level,
                                    lifespan="on", http=guarded_protocol_class(config.limits), access_log=False,
                                    timeout_graceful_shutdown=config.shutdown_timeout + 5)
    # uvicorn.asgi at trace would log each request's scope, query string included: kept at debug at most.
    logging.getLogger("uvicorn.asgi").setLevel(max(logging.DEBUG, logging.getLogger("uvicorn.asgi").level))
    return _graceful_server_class()(uvicorn_config, engines, config.shutdown_timeout)


def _start_engines(configs: list, engine_process: bool, max_restarts: int, on_fatal) -> list:
    """One engine per model, each core in a process of its own (started together), or in this process."""
    from concurrent.futures import ThreadPoolExecutor

    from sobrio.engine.async_llm import AsyncMPClient

    if not engine_process:
        return [AsyncLLM.from_config(c) for c in configs]
    with ThreadPoolExecutor(len(configs)) as pool:
        futures = [pool.submit(AsyncMPClient, c, max_restarts, on_fatal=on_fatal) for c in configs]
        errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for f in futures:
            if f.exception() is None:
                f.result().shutdown()
        raise errors[0]
    return [f.result() for f in futures]


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

        def __init__(self, config, engines: list[EngineClient], drain_timeout: float):
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
