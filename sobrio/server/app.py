"""`sobrio serve`: the OpenAI-compatible HTTP API over one EngineClient per served model."""

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import sobrio
from sobrio.agents import routes as agent_routes
from sobrio.config import LimitsConfig, ServerConfig, SobrioConfig
from sobrio.engine.async_llm import AsyncLLM
from sobrio.engine.client import EngineClient
from sobrio.engine.outputs import RequestOutput
from sobrio.engine_args import add_config_args, add_engine_args, config_from_args, engine_kwargs
from sobrio.errors import (
    ConfigError,
    EngineStepError,
    InvalidRequestError,
    SobrioError,
)
from sobrio.gateway.backends import (
    Backends,
    LocalReplica,
    ModelBackends,
    NoBackendAvailable,
    RemoteReplica,
    prefix_hashes,
)
from sobrio.gateway.config import GatewayConfig, load_gateway_config
from sobrio.gateway.dashboard import dashboard_data
from sobrio.gateway.dashboard import render as render_dashboard
from sobrio.gateway.energy import region_code
from sobrio.gateway.gate import bearer, cache_salt, kv_offload_policy, reserve_tokens
from sobrio.gateway.ledger import Ledger, LedgerEntry
from sobrio.gateway.proxy import BackendFailed, forward, payload_for
from sobrio.gateway.regions import region_allowed, region_refusal
from sobrio.gateway.router import Router, RouterWeights
from sobrio.gateway.router_savings import RouterInfo
from sobrio.gateway.tenants import TenantStore, check_model_allowed
from sobrio.ids import new_id
from sobrio.loader.resolve import ALIASES, DEFAULT_MODELS, check_model_name, is_installed, resolve_model
from sobrio.sample.params import SamplingParams
from sobrio.server import lora_routes, responses_api, routes_tokenize, tools
from sobrio.server.budgets import remote_worst_case, worst_case_tokens
from sobrio.server.disconnect import unless_disconnected
from sobrio.server.edge import edge_stack, install_openapi
from sobrio.server.embeddings import install_embedding_routes, select_engine, start_engines_with_embedders
from sobrio.server.errors import error_response, log_unexpected, sobrio_error_response
from sobrio.server.limits import check_fanout, check_prompt_tokens
from sobrio.server.limits import protocol_class as guarded_protocol_class
from sobrio.server.lora_routes import AdapterEngine, adapter_cards, find_adapter
from sobrio.server.metrics import ServerMetrics
from sobrio.server.protocol import ChatCompletionRequest, CompletionRequest, ignored_fields, log_ignored, now
from sobrio.server.responses import ChoiceState, chat_chunk, completion_chunk, final_response, note_usage, usage_of
from sobrio.server.startup import (
    RootPath,
    StatsLogger,
    bind_socket,
    listening_url,
    served_names,
    with_paths_as_given,
)
from sobrio.timing import log_step, start_together

logger = logging.getLogger("sobrio.server")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A message naming the field, never echoing the value sent."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    if first.get("type") == "extra_forbidden":
        return f"field {'.'.join(loc)!r} is not supported by sobrio", param
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


class OpenAIServer:
    def __init__(self, engines: dict[str, EngineClient], limits: LimitsConfig | None = None,
                 default_max_tokens: int | None = ServerConfig.default_max_tokens,
                 metrics_prefix: str = ServerConfig.metrics_prefix, region: str = "WLD"):
        self.engines = engines  # the local engine cores (a gateway of remote backends only may have none)
        self.region = region  # where the local engines run (--region)
        self.backends = Backends({name: ModelBackends(name, [LocalReplica(e, region)]) for name, e in engines.items()})
        self.limits = limits or LimitsConfig()
        self.default_max_tokens = default_max_tokens or None  # 0: up to the context
        self.metrics = ServerMetrics(engines, metrics_prefix)
        self.aliases: dict[str, str] = {}  # a model's further --served-model-name -> its main name
        self.log_requests = True  # --disable-log-requests: False
        self.ledger: Ledger | None = None  # run_server's: the gateway's usage ledger
        self.router: Router | None = None  # run_server's, when both of its models are served: model "auto"
        self.router_info: RouterInfo | None = None  # its models, evaluation and prices, for the dashboard
        self.store: TenantStore | None = None  # run_server's: tenants (the dashboard names them)
        self.operator_key: str | None = None  # --api-key: opens /dashboard
        self.self_url: str | None = None  # run_server's loopback URL: sub-agents of /v1/agents/runs call it
        self.agent_skills: str | None = None  # --agent-skills: the skills those teams may use
        for name, engine in engines.items():
            engine.on_output = lambda output, t, name=name: self._on_output(name, output, t)
            engine.on_abort = self.metrics.forget

    def _on_output(self, model_name: str, output: RequestOutput, t: float) -> None:
        self.metrics.observe(model_name, output, t)
        if output.finished and self.log_requests:
            m, c = output.metrics, output.outputs[0]
            ttft = (m.first_token_time or t) - m.arrival_time
            logger.info("request %s seq %d model=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d "
                        "ttft=%.3fs e2e=%.3fs finish=%s", output.request_id, c.index, model_name,
                        len(output.prompt_token_ids), output.num_cached_tokens, len(c.token_ids), ttft,
                        t - m.arrival_time, c.finish_reason)

    def engine_for(self, model: str | None, task: str | None = None, state=None) -> tuple[str, EngineClient]:
        """`task` "generate" or "embed": a model of the other kind is a 400 (None: any model). A further
        --served-model-name of a model reaches it, and answers carry the name the request used (as vLLM).
        `state` (a request's): its tenant must be allowed the model (403), and its ledger row names it."""
        if model in self.backends.models and model not in self.engines:
            raise InvalidRequestError(f"model {model!r} is served by remote backends, which only "
                                      "/v1/chat/completions and /v1/completions reach", param="model")
        adapter = find_adapter(self.engines, model) if model not in self.engines else None
        if adapter is not None:  # a LoRA adapter's name: its base model's engine, the adapter on every request
            name, engine = model, AdapterEngine(select_engine(self.engines, adapter[0], task)[1], adapter[1])
        elif model in self.aliases:
            name, engine = model, select_engine(self.engines, self.aliases[model], task)[1]
        else:
            name, engine = select_engine(self.engines, model, task)
        tenant = self._admit_model(state, name, self.aliases.get(name, name))
        if tenant is not None and not region_allowed(self.region, tenant.limits.allowed_regions):
            raise region_refusal(tenant, name, [self.region])
        return name, engine

    @staticmethod
    def _admit_model(state, name: str, main: str):
        """The request's tenant must be allowed the model under either name (403); its ledger row names the
        model asked for and the one serving. Returns the tenant (None without one)."""
        tenant, entry = getattr(state, "tenant", None), getattr(state, "ledger", None)
        if tenant is not None:
            check_model_allowed(tenant, name, main)
        if entry is not None:
            entry.requested_model = entry.requested_model or name
            entry.served_model = main
        return tenant

    def add_backends(self, gateway: GatewayConfig) -> None:
        """The configuration file's remote replicas, beside (or instead of) each model's local engine."""
        for spec in gateway.models.values():
            remotes = [RemoteReplica(r) for r in spec.remotes]
            pool = self.backends.models.get(spec.name)
            if pool is None:
                self.backends.models[spec.name] = ModelBackends(spec.name, remotes)
            else:
                pool.replicas.extend(remotes)

    def model_names(self) -> list[str]:
        """Every model a client may name: local engines, their further names, remote-only models."""
        return [*self.engines, *self.aliases, *(m for m in self.backends.models if m not in self.engines)]

    async def via_remote(self, model: str | None, endpoint: str, body, request: Request):
        """The answer of a remote replica when the model has remote ones and one is chosen (a failure before
        its first byte retried once on another); None when the local engine takes the request."""
        if not model and not self.engines:  # a gateway of remote backends only: its first model
            model = next(iter(self.backends.models))
        pool = self.backends.models.get(self.aliases.get(model, model)) if model else None
        if pool is None or not any(r.is_remote for r in pool.replicas):
            return None  # local engines only: as without a gateway configuration
        state = request.state
        tenant = self._admit_model(state, model, pool.model)
        state.request_id = new_id("chatcmpl" if endpoint.startswith("chat") else "cmpl")
        reserve_tokens(state, remote_worst_case(body, self.default_max_tokens))
        hashes, tried, failure = prefix_hashes(affinity_text(body)), [], None
        fields = body.model_dump(mode="json", exclude_unset=True)
        wants_usage = bool(body.stream_options and body.stream_options.include_usage)
        entry = getattr(state, "ledger", None)
        for _ in range(2):
            try:
                replica = pool.choose(hashes, tenant, exclude=tried)
            except NoBackendAvailable:
                raise failure or NoBackendAvailable(f"no backend of model {model!r} is available") from None
            if not replica.is_remote:
                return None
            payload = payload_for(replica, fields, cache_salt(state, body.cache_salt), bool(body.stream))
            try:
                answer = await unless_disconnected(forward(replica, endpoint, payload, model, entry, wants_usage),
                                                   request)
                return Response(status_code=499) if answer is None else answer
            except BackendFailed as exc:
                tried.append(replica)
                failure = exc
        raise failure

    async def resolve_auto(self, model: str | None, text: str, state, endpoint: str = "completions") -> str | None:
        """Model "auto": the router's choice for this request's text, said in response headers; any other
        name as it is; none: the tenant's default model, if it has one. The choice is among the router's
        models that can answer `endpoint` ("chat": those with a chat template)."""
        tenant = getattr(state, "tenant", None)
        if not model and tenant is not None:
            model = tenant.limits.default_model
        if model != "auto":
            return model
        if self.router is None:
            raise InvalidRequestError('model "auto" needs the router, which needs both of its models served: '
                                      "sobrio serve smollm2-135m --model gemma3-270m", param="model")
        chosen, score = self.router.choose(text)
        if not self.can_answer(chosen, endpoint):
            weights = self.router.weights
            other = weights.small if chosen == weights.large else weights.large
            if not self.can_answer(other, endpoint):
                raise InvalidRequestError(f'model "auto": neither {chosen} nor {other} can answer {endpoint} '
                                          "requests (no chat template)", param="model")
            chosen = other
        state.response_headers = [(b"x-sobrio-routed-to", chosen.encode()),
                                  (b"x-sobrio-router-score", f"{score:.3f}".encode())]
        if getattr(state, "ledger", None) is not None:
            state.ledger.requested_model = "auto"
            state.ledger.router_score = score
        return chosen

    def can_answer(self, name: str, endpoint: str) -> bool:
        """Whether a served model can answer this endpoint: a generating model, with a chat template for chat.
        A remote model is trusted to."""
        engine = self.engines.get(self.aliases.get(name, name))
        if engine is None:
            return True
        if getattr(engine, "task", "generate") != "generate":
            return False
        return endpoint != "chat" or bool(getattr(engine.input_processor.tokenizer, "chat_template", None))

    def check_fanout(self, engine: EngineClient, num_prompts: int, n: int) -> None:
        """Prompts and sequences against the limits and the waiting queue, before any tokenizing."""
        waiting = engine.stats()["num_requests_waiting"]
        check_fanout(self.limits, num_prompts, n, waiting, engine.max_num_waiting)

    def params_for(self, params: SamplingParams, num_prompt_tokens: int, max_model_len: int,
                   model_max_tokens: int | None = None) -> SamplingParams:
        """A request without max_tokens gets the model's default (its generation config's max_new_tokens) or
        the server's, capped at what the context leaves (vLLM caps at the context); a prompt that leaves
        nothing is refused by the engine with its own message."""
        room = max_model_len - num_prompt_tokens
        default = model_max_tokens or self.default_max_tokens
        if params.max_tokens is not None or default is None or room <= 0:
            return params
        return dataclasses.replace(params, max_tokens=min(default, room))

    async def submit(self, engine: EngineClient, base_id: str, prompts: list[list[int]], params: list[SamplingParams],
                     cache_salt, queue, priority: int = 0, state=None) -> list[str]:
        """Add one engine request per prompt; on any failure abort those already added and re-raise. `state`
        (the request's): its tenant's KV offload policy."""
        offload = kv_offload_policy(state)
        reserve_tokens(state, worst_case_tokens(prompts, params, engine.max_model_len))
        ids: list[str] = []
        try:
            for i, (prompt_ids, prompt_params) in enumerate(zip(prompts, params, strict=True)):
                request_id = f"{base_id}-{i}"
                await engine.add_request(request_id, None, prompt_params, queue, prompt_token_ids=prompt_ids,
                                         cache_salt=cache_salt, priority=priority, kv_offload=offload)
                ids.append(request_id)
        except BaseException:
            for request_id in ids:
                engine.abort(request_id)
            raise
        return ids


def create_app(engines: dict[str, EngineClient], limits: LimitsConfig | None = None,
               default_max_tokens: int | None = ServerConfig.default_max_tokens,
               metrics_prefix: str = ServerConfig.metrics_prefix, region: str = "WLD") -> FastAPI:
    """The API itself; `edge_stack` wraps it with auth, CORS, limits, request ids and the access log."""
    server = OpenAIServer(engines, limits, default_max_tokens, metrics_prefix, region)
    app = FastAPI(title="sobrio", version=sobrio.__version__)
    app.state.server = server
    install_error_handlers(app)
    install_openapi(app)
    install_embedding_routes(app, server)

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
    async def models(request: Request):
        """The served models; for a tenant limited to some, those it may use."""
        names = [(name, name) for name in server.engines] + list(server.aliases.items())
        data = [{"id": name, "object": "model", "created": now(), "owned_by": "sobrio", "root": main,
                 "max_model_len": server.engines[main].max_model_len} for name, main in names]
        data += [{"id": name, "object": "model", "created": now(), "owned_by": "sobrio", "root": name}
                 for name in server.backends.models if name not in server.engines]
        data += adapter_cards(server.engines, now())
        allowed = getattr(getattr(request.state, "tenant", None), "limits", None)
        if allowed is not None and allowed.allowed_models is not None:
            data = [m for m in data if {m["id"], m["root"]} & set(allowed.allowed_models)]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        users = [m.content for m in body.messages if m.role == "user" and isinstance(m.content, str)]
        model = await server.resolve_auto(body.model, users[-1] if users else "", request.state, "chat")
        remote = await server.via_remote(model, "chat/completions", body, request)
        if remote is not None:
            return remote
        name, engine = server.engine_for(model, "generate", request.state)
        tool_plan = tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls)
        params = tools.with_tool_grammar(body.to_sampling_params(), tool_plan)
        server.check_fanout(engine, 1, params.n)
        try:
            messages = [m.template_dict() for m in body.messages]
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="messages") from None
        template = getattr(engine.input_processor.tokenizer, "chat_template", None)
        messages, template_tools = tools.prompt(messages, body.tools, tool_plan, template)
        ids = await asyncio.to_thread(engine.input_processor.chat_prompt_ids, messages, body.add_generation_prompt,
                                      template_kwargs=body.chat_template_kwargs, tools=template_tools)
        return await _respond(server, request, body, params, name, engine, [ids], "chat", tool_plan=tool_plan)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = body.prompts()
        text = prompts[0] if prompts and isinstance(prompts[0], str) else ""
        model = await server.resolve_auto(body.model, text, request.state)
        remote = await server.via_remote(model, "completions", body, request)
        if remote is not None:
            return remote
        name, engine = server.engine_for(model, "generate", request.state)
        params = body.to_sampling_params()
        server.check_fanout(engine, len(prompts), params.n)
        tokenize = engine.input_processor.tokenize
        ids = await asyncio.to_thread(lambda: [tokenize(p) for p in prompts])
        echo = await asyncio.to_thread(echo_texts, engine, prompts) if body.echo else None
        return await _respond(server, request, body, params, name, engine, ids, "completion", echo)

    @app.get("/v1/usage")
    async def usage(request: Request, since: float = 0.0, limit: int = 100):
        """The caller's own ledger rows (newest first) and totals since `since` (epoch seconds): a tenant's
        key sees its tenant's, the operator's key (or no key on an open server) the requests without one."""
        if server.ledger is None:
            raise InvalidRequestError("this server keeps no usage ledger")
        if not 1 <= limit <= 1000:
            raise InvalidRequestError("limit must be in [1, 1000]", param="limit")
        tenant = getattr(request.state, "tenant", None)
        tenant_id = tenant.id if tenant is not None else None
        return {"object": "list", "tenant": tenant.name if tenant is not None else None,
                "data": server.ledger.rows(tenant_id, since, limit), "totals": server.ledger.totals(tenant_id, since)}

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard(request: Request, key: str | None = None):
        """The operator's page (gateway/dashboard.py): the server's --api-key as a Bearer header or ?key=."""
        if server.operator_key is None or server.ledger is None:
            return error_response(403, "the dashboard opens with the server's --api-key; start it with one",
                                  "permission_error")
        given = key or bearer(request.headers.get("authorization", "").encode("latin-1"))
        if not hmac.compare_digest(given.encode(), server.operator_key.encode()):
            return error_response(401, "invalid or missing API key", "invalid_request_error", code="invalid_api_key")
        return HTMLResponse(render_dashboard(dashboard_data(server.ledger, server.store, server.router_info)))

    lora_routes.register(app, server)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    routes_tokenize.register(app, server)  # /tokenize, /detokenize, /v1/models/{id}, /ping
    agent_routes.register(app, server)  # /v1/agents/runs
    responses_api.register(app, server, _collect_unless_disconnected, sobrio_error_response)  # /v1/responses
    return app


async def _respond(server: OpenAIServer, request: Request, body, params: SamplingParams, model_name: str,
                   engine: EngineClient, prompts: list[list[int]], kind: str, echo: list[str] | None = None,
                   tool_plan: tools.ToolPlan | None = None):
    check_prompt_tokens(server.limits, [len(p) for p in prompts], params.n)
    max_model_len = engine.max_model_len
    defaults = getattr(engine, "default_sampling", None) or {}  # --generation-config
    params = with_model_defaults(params, body, defaults)
    per_prompt = [server.params_for(params, len(p), max_model_len, defaults.get("max_tokens")) for p in prompts]
    base_id = new_id("chatcmpl" if kind == "chat" else "cmpl")
    request.state.request_id = base_id  # X-Request-Id of the answer, unless the client sent its own
    log_ignored(ignored_fields(body), base_id)
    queue: asyncio.Queue = asyncio.Queue()
    try:
        request_ids = await server.submit(engine, base_id, prompts, per_prompt,
                                          cache_salt(request.state, body.cache_salt), queue, body.priority,
                                          request.state)
    except InvalidRequestError as exc:  # a grammar the front refused: name the field the request gave it in
        if exc.param != "structured_outputs" or body.structured_outputs is not None:
            raise
        raise InvalidRequestError(str(exc), param="tools" if tool_plan is not None else "response_format") from None
    stream = engine.stream_outputs(request_ids, params.n, queue)
    choices = ChoiceState(request_ids, params.n, params.logprobs, echo, params.prompt_logprobs,
                          engine.input_processor.decode)
    choices.tool_calls = tool_plan is not None
    choices.forced_tool_calls = tool_plan is not None and tool_plan.choice != "auto"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        sse = _sse(stream, choices, base_id, model_name, kind, include_usage, getattr(request.state, "ledger", None))
        return StreamingResponse(sse, media_type="text/event-stream")
    try:
        outputs = await _collect_unless_disconnected(stream, request)
    except EngineStepError as exc:
        return sobrio_error_response(exc)
    if outputs is None:
        return Response(status_code=499)
    for output in outputs:
        choices.add(output)
    note_usage(getattr(request.state, "ledger", None), choices)
    return final_response(choices, base_id, model_name, kind)


def affinity_text(body) -> str:
    """The text a remote replica's prefix affinity looks at: the conversation, or the first prompt."""
    if hasattr(body, "messages"):
        return "".join(f"{m.role}\n{m.content}\n" for m in body.messages if isinstance(m.content, str))
    prompts = body.prompts()
    return prompts[0] if prompts and isinstance(prompts[0], str) else ""


def with_model_defaults(params: SamplingParams, body, defaults: dict) -> SamplingParams:
    """The model's default sampling parameters (--generation-config) for the fields the request left unset."""
    unset = {k: v for k, v in defaults.items() if k != "max_tokens" and getattr(body, k, 0) is None}
    return dataclasses.replace(params, **unset) if unset else params


def echo_texts(engine: EngineClient, prompts: list) -> list[str]:
    """What `echo` puts before each completion: the prompt as sent, or its token ids as text."""
    return [p if isinstance(p, str) else engine.input_processor.decode(p, "prompt") for p in prompts]


async def _collect_unless_disconnected(stream: AsyncIterator[RequestOutput], request: Request):
    """Gather a non-streamed request's outputs; if the client goes away first, abort it (None)."""
    try:
        return await unless_disconnected(_collect(stream), request)
    finally:
        await stream.aclose()  # aborts whatever is unfinished


async def _collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [o async for o in stream]


async def _sse(stream: AsyncIterator[RequestOutput], choices: ChoiceState, base_id: str, model_name: str,
               kind: str, include_usage: bool, entry: LedgerEntry | None = None) -> AsyncIterator[str]:
    """The stream's chunks; a failure (the engine's, a shutdown's, or a bug) ends it with an OpenAI error
    event and then `[DONE]`, so a client can tell a cut from a finished answer. The ledger row gets the
    tokens streamed, however the stream ends."""
    created = now()
    make_chunk = chat_chunk if kind == "chat" else completion_chunk
    try:
        async for output in stream:
            if entry is not None and entry.ttft_s is None:
                entry.ttft_s = time.time() - entry.created_at
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
        error = sobrio_error_response(exc)
        if entry is not None:
            entry.status = error.status_code
        yield f"data: {json.dumps(json.loads(error.body))}\n\n"
    except Exception as exc:  # noqa: BLE001 - a bug mid-stream: say so in the stream, log no message
        log_unexpected(exc, "stream")
        if entry is not None:
            entry.status = 500
        yield f"data: {json.dumps(json.loads(error_response(500, 'internal server error', 'server_error').body))}\n\n"
    finally:
        note_usage(entry, choices)
        await stream.aclose()
    yield "data: [DONE]\n\n"


def add_serve_parser(sub) -> None:
    """`sobrio serve [MODEL]`: ServerConfig's flags (with nested limits and CORS), then every engine concern's,
    then the vLLM flags sobrio refuses; the help ends with the environment variables sobrio reads."""
    from sobrio.engine_args import ENVIRONMENT, HelpFormatter

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (as `vllm serve`)",
                           description="Serve models over an OpenAI-compatible HTTP API. The flags are vLLM's; "
                                       "MODEL and --model may be combined (MODEL is served first).",
                           epilog=ENVIRONMENT, formatter_class=HelpFormatter)
    add_config_args(serve, ServerConfig)
    add_engine_args(serve, with_model=False)
    serve.set_defaults(func=run_server)


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


def run_server(args) -> int:
    """Check the flags and models, bind the port, load every model, then serve; each step logged with its
    timing. Errors a user can fix raise (the CLI prints one line and exits 2, or 1 for a busy port)."""
    started = time.monotonic()
    config = config_from_args(args, ServerConfig)
    _configure_logging(config.log_level)
    gateway = load_gateway_config(config.config)
    models = _served_models(config, gateway)
    region = region_code(config.region)  # an unknown one fails now, before anything loads
    names = with_paths_as_given(models, served_names([m if m in ALIASES else resolve_model(m).name for m in models],
                                                     config.served_model_name), config.served_model_name)
    configs = [SobrioConfig.from_kwargs(model=model, **engine_kwargs(args)) for model in models]
    sock = bind_socket(config.host, config.port)  # a busy port fails now, not after loading
    fatal = threading.Event()  # an engine core that keeps dying: exit non-zero for a supervisor
    try:
        clients = _start_local_models(config, models, configs, fatal.set)
    except ConfigError:
        sock.close()
        raise  # a flag the model refuses (--quantization awq on a float checkpoint): exit 2, as a bad flag does
    except SobrioError as exc:
        sock.close()
        logger.error("%s", exc)
        return 1
    engines = {group[0]: client for group, client in zip(names, clients)}
    app = create_app(engines, config.limits, config.default_max_tokens, config.metrics_prefix, region)
    app.state.server.aliases = {alias: group[0] for group in names for alias in group[1:]}
    app.state.server.log_requests = not config.disable_log_requests
    app.state.server.add_backends(gateway)
    app.state.server.router = router = _start_router(config, gateway, app.state.server)
    if router is not None:
        app.state.server.router_info = RouterInfo(router.weights.small, router.weights.large, router.weights.quality,
                                                  gateway.router.small_usd_per_mtok, gateway.router.large_usd_per_mtok)
    stats = None if config.disable_log_stats else StatsLogger(engines)
    store = TenantStore(config.db)
    store.defaults = gateway.tenant_defaults
    ledger = app.state.server.ledger = Ledger(store.db)
    app.state.server.store, app.state.server.operator_key = store, config.api_key
    logger.info("tenants, keys and usage ledger: %s (%d tenant(s))", store.path, len(store.tenants()))
    asgi, limits_layer = edge_stack(app, config.api_key, config.limits, config.cors, store, ledger, region,
                                    config.metrics_require_key)
    if config.root_path:
        asgi = RootPath(asgi, config.root_path)
    url = listening_url(config, sock)
    scheme, port = "https" if config.ssl_certfile else "http", sock.getsockname()[1]
    app.state.server.self_url = f"{scheme}://127.0.0.1:{port}{config.root_path or ''}"  # loopback, any --host
    app.state.server.agent_skills = config.agent_skills

    @app.on_event("startup")
    async def _listening():
        remote = [f"{m.model} ({len(m.replicas)} replica(s))" for m in app.state.server.backends.models.values()
                  if any(r.is_remote for r in m.replicas)]
        logger.info("listening on %s: %s (start-up took %.1fs)", url, ", ".join(
            [" = ".join(group) for group in names] + remote), time.monotonic() - started)
        if stats is not None:
            stats.start()
        if app.state.server.backends.remote_replicas():
            app.state.backend_checks = asyncio.create_task(app.state.server.backends.watch())
        app.state.tenant_deletions = asyncio.create_task(store.watch_deletions(
            lambda salt: [e.purge_cache_salt(salt) for e in engines.values() if hasattr(e, "purge_cache_salt")]))

    @app.on_event("shutdown")
    async def _stop_engines():
        for task in (getattr(app.state, "backend_checks", None), getattr(app.state, "tenant_deletions", None)):
            if task is not None:
                task.cancel()
        await app.state.server.backends.close()
        if stats is not None:
            stats.stop()
        for engine in engines.values():
            engine.shutdown()
        store.close()

    server = _uvicorn_server(config, asgi, list(engines.values()))
    limits_layer.count_connections = lambda: len(server.server_state.connections)
    threading.Thread(target=_exit_on_fatal, args=(fatal, server), daemon=True).start()
    server.run(sockets=[sock])
    return 1 if fatal.is_set() else 0


def _start_router(config: ServerConfig, gateway: GatewayConfig, server: OpenAIServer) -> Router | None:
    """Model "auto", when the served models (local or remote) include both of the router's: the weights'
    own two, or the configuration's [router] small and large. Its threshold: --router-threshold, else
    --router-strong-share, else [router] threshold or strong_share, else the weights' own."""
    spec = gateway.router
    weights = RouterWeights.load(config.router_weights or spec.weights)
    weights = dataclasses.replace(weights, small=spec.small or weights.small, large=spec.large or weights.large)
    if not {weights.small, weights.large} <= set(server.model_names()):
        logger.info('model "auto" is off: the router needs %s and %s served', weights.small, weights.large)
        return None
    threshold = next((t for t in (config.router_threshold, _share_threshold(weights, config.router_strong_share),
                                  spec.threshold, _share_threshold(weights, spec.strong_share)) if t is not None),
                     None)
    with log_step(logger, 'starting the router for model "auto" (%s and %s)', weights.small, weights.large):
        return Router(weights, threshold=threshold)


def _share_threshold(weights: RouterWeights, share: float | None) -> float | None:
    return None if share is None else weights.threshold_for_share(share)


def _uvicorn_server(config: ServerConfig, asgi, engines: list[EngineClient]):
    """uvicorn with our h11 protocol (header and discard deadlines), no access log (HttpEdge logs, without
    queries), TLS when given a key and certificate, and a graceful shutdown whose own deadline is a backstop
    a little after ours: by then every request has had its error answer."""
    import uvicorn

    uvicorn_level = config.uvicorn_log_level or config.log_level
    uvicorn_config = uvicorn.Config(asgi, host=config.host, port=config.port, log_level=uvicorn_level,
                                    lifespan="on", http=guarded_protocol_class(config.limits), access_log=False,
                                    timeout_graceful_shutdown=config.shutdown_timeout + 5,
                                    ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
                                    ssl_ca_certs=config.ssl_ca_certs, ssl_cert_reqs=config.ssl_cert_reqs)
    # uvicorn.asgi at trace would log each request's scope, query string included: kept at debug at most.
    logging.getLogger("uvicorn.asgi").setLevel(max(logging.DEBUG, logging.getLogger("uvicorn.asgi").level))
    return _graceful_server_class()(uvicorn_config, engines, config.shutdown_timeout)


def _start_local_models(config: ServerConfig, models: list[str], configs: list, on_fatal) -> list:
    """The local models' engines (embedding models: in this process, server/embeddings.py); none for a
    gateway of remote backends only."""
    if not models:
        logger.info("no local model: every model is served by remote backends")
        return []
    with log_step(logger, "starting %d model(s): %s", len(models), ", ".join(models)):
        return start_engines_with_embedders(configs, lambda generative: _start_engines(
            generative, config.engine_process, config.engine_restarts, on_fatal))


def _start_engines(configs: list, engine_process: bool, max_restarts: int, on_fatal) -> list:
    """One engine per model, each core in a process of its own (started together), or in this process."""
    from sobrio.engine.async_llm import AsyncMPClient

    if not engine_process:
        return [AsyncLLM.from_config(c) for c in configs]
    if any(c.parallel_config.distributed_executor_backend == "ray" for c in configs):
        from sobrio.distributed.ray_workers import connect_ray

        connect_ray()  # from this thread: Ray's local processes die with the thread that started them
    starters = [functools.partial(AsyncMPClient, c, max_restarts, on_fatal=on_fatal) for c in configs]
    return start_together(starters, lambda client: client.shutdown())


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
