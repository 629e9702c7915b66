"""`sobrio serve`: the OpenAI-compatible HTTP API over one AsyncLLM per served model."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import sobrio
from sobrio.engine.async_llm import AsyncLLM, EngineStepError
from sobrio.engine.outputs import RequestOutput
from sobrio.errors import EngineOverloadedError, InvalidRequestError, SobrioError, UnknownModelError
from sobrio.server.metrics import ServerMetrics
from sobrio.server.protocol import ChatCompletionRequest, CompletionRequest, new_id, now
from sobrio.server.responses import ChoiceState, chat_chunk, completion_chunk, final_response, usage_of

logger = logging.getLogger("sobrio.server")


def error_response(status: int, message: str, err_type: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


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
    def __init__(self, engines: dict[str, AsyncLLM], api_key: str | None = None):
        assert engines, "at least one model must be served"
        self.engines = engines
        self.api_key = api_key
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

    def engine_for(self, model: str | None) -> tuple[str, AsyncLLM]:
        if model is None or model == "":
            name = next(iter(self.engines))
            return name, self.engines[name]
        if model not in self.engines:
            raise UnknownModelError(f"model {model!r} is not served here; served: {', '.join(self.engines)}")
        return model, self.engines[model]

    def authorized(self, request: Request) -> bool:
        if not self.api_key:
            return True
        return request.headers.get("authorization", "") == f"Bearer {self.api_key}"

    async def submit(self, engine: AsyncLLM, base_id: str, prompts: list[dict], params, cache_salt, queue) -> list[str]:
        """Add one engine request per prompt; on any failure abort those already added and re-raise."""
        ids: list[str] = []
        try:
            for i, prompt in enumerate(prompts):
                request_id = f"{base_id}-{i}"
                await engine.add_request(request_id, prompt.get("text"), params, queue,
                                         prompt_token_ids=prompt.get("ids"), cache_salt=cache_salt)
                ids.append(request_id)
        except BaseException:
            for request_id in ids:
                engine.abort(request_id)
            raise
        return ids


def create_app(engines: dict[str, AsyncLLM], api_key: str | None = None) -> FastAPI:
    server = OpenAIServer(engines, api_key)
    app = FastAPI(title="sobrio", version=sobrio.__version__)
    app.state.server = server
    install_error_handlers(app)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if request.url.path.startswith("/v1") and not server.authorized(request):
            return error_response(401, "invalid or missing API key", "invalid_request_error", code="invalid_api_key")
        return await call_next(request)

    @app.get("/health")
    async def health():
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
                 "max_model_len": engine.engine.max_model_len} for name, engine in server.engines.items()]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        name, engine = server.engine_for(body.model)
        try:
            messages = [m.template_dict() for m in body.messages]
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="messages") from None
        ids = await asyncio.to_thread(engine.engine.input_processor.chat_prompt_ids, messages,
                                      body.add_generation_prompt)
        return await _respond(server, request, body, name, engine, [{"ids": ids}], "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        name, engine = server.engine_for(body.model)
        prompts = [{"text": p} if isinstance(p, str) else {"ids": p} for p in body.prompts()]
        return await _respond(server, request, body, name, engine, prompts, "completion")

    return app


async def _respond(server: OpenAIServer, request: Request, body, model_name: str, engine: AsyncLLM,
                   prompts: list[dict], kind: str):
    params = body.to_sampling_params()
    base_id = new_id("chatcmpl" if kind == "chat" else "cmpl")
    queue: asyncio.Queue = asyncio.Queue()
    request_ids = await server.submit(engine, base_id, prompts, params, body.cache_salt, queue)
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
    """Gather a non-streamed request's outputs; abort it if the client goes away meanwhile."""
    async def collect():
        return [o async for o in stream]

    task = asyncio.ensure_future(collect())
    while not task.done():
        await asyncio.wait([task], timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await stream.aclose()
            return None
    return task.result()


async def _sse(stream: AsyncIterator[RequestOutput], choices: ChoiceState, base_id: str, model_name: str,
               kind: str, include_usage: bool) -> AsyncIterator[str]:
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
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"


def add_serve_parser(sub, add_engine_args) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve, multi_model=True)
    serve.add_argument("--served-model-name", action="append", default=None,
                       help="name a --model is served under (repeatable, in --model order)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=run_server)


def run_server(args) -> int:
    import uvicorn

    from sobrio.cli import engine_kwargs
    from sobrio.config import EngineConfig
    from sobrio.loader.resolve import DEFAULT_MODELS, is_installed

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    models = args.model or [m for m in DEFAULT_MODELS if is_installed(m)]
    names = list(args.served_model_name or [])
    if len(names) > len(models):
        raise SystemExit("more --served-model-name than --model")
    engines = {}
    for i, model in enumerate(models):
        engine = AsyncLLM.from_config(EngineConfig(model=model, **engine_kwargs(args)))
        engines[names[i] if i < len(names) else (model if model in DEFAULT_MODELS else engine.model_name)] = engine
    app = create_app(engines, args.api_key)

    @app.on_event("shutdown")
    async def _stop_engines():
        for engine in engines.values():
            engine.shutdown()

    logger.info("serving %s on http://%s:%d", ", ".join(engines), args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=30, access_log=True)
    _graceful_server_class()(config).run()
    return 0


def _graceful_server_class():
    import uvicorn

    class _GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM after draining, so the process dies with status -15; we exit 0 instead."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return _GracefulServer
