"""The OpenAI-compatible HTTP API over one client per served model (`create_app`), and the server's own state:
its engines, their names, the gateway in front of them, the limits and metrics (`OpenAIServer`).

The routes live beside this file (`routes.py`: chat, completions, models...; `generate.py`: one generation
request from tokens to its answer); `serving.py` starts it all (`sobrio serve`).
"""

import dataclasses
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import sobrio
from sobrio.config import LimitsConfig, ServerConfig
from sobrio.engine.client import EngineClient, Served
from sobrio.engine.outputs import RequestOutput
from sobrio.errors import InvalidRequestError, SobrioError
from sobrio.gateway.gate import kv_offload_policy, reserve_tokens
from sobrio.gateway.gateway import Gateway
from sobrio.server import lora_routes, responses_api, routes, routes_tokenize
from sobrio.server.budgets import worst_case_tokens
from sobrio.server.edge import install_openapi
from sobrio.server.embeddings import install_embedding_routes, select_engine
from sobrio.server.errors import error_response, sobrio_error_response
from sobrio.server.limits import check_fanout
from sobrio.server.lora_routes import find_adapter
from sobrio.server.prometheus import ServerMetrics
from sobrio.types.params import SamplingParams

logger = logging.getLogger("sobrio.server")


class OpenAIServer:
    def __init__(self, engines: dict[str, Served], limits: LimitsConfig | None = None,
                 default_max_tokens: int | None = ServerConfig.default_max_tokens,
                 metrics_prefix: str = ServerConfig.metrics_prefix, region: str = "WLD"):
        self.engines = engines  # the local engine cores (a gateway of remote backends only may have none)
        self.gateway = Gateway(engines, region)
        self.limits = limits or LimitsConfig()
        self.default_max_tokens = default_max_tokens or None  # 0: up to the context
        self.metrics = ServerMetrics(engines, metrics_prefix)
        self.aliases: dict[str, str] = {}  # a model's further --served-model-name -> its main name
        self.log_requests = True  # --disable-log-requests: False
        self.self_url: str | None = None  # run_server's loopback URL: sub-agents of /v1/agents/runs call it
        self.agent_skills: str | None = None  # --agent-skills: the skills those teams may use
        for name, engine in engines.items():
            if engine.task == "generate":
                engine.subscribe(on_output=lambda output, t, name=name: self._on_output(name, output, t),
                                 on_abort=self.metrics.forget)
            else:
                engine.subscribe(on_finished=lambda stats, name=name: self.metrics.observe_embedding(name, stats))

    def _on_output(self, model_name: str, output: RequestOutput, t: float) -> None:
        self.metrics.observe(model_name, output, t)
        if output.finished and self.log_requests:
            m, c = output.metrics, output.outputs[0]
            ttft = (m.first_token_time or t) - m.arrival_time
            logger.info("request %s seq %d model=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d "
                        "ttft=%.3fs e2e=%.3fs finish=%s", output.request_id, c.index, model_name,
                        len(output.prompt_token_ids), output.num_cached_tokens, len(c.token_ids), ttft,
                        t - m.arrival_time, c.finish_reason)

    def engine_for(self, model: str | None, task: str | None = None, state=None) -> tuple[str, Served]:
        """`task` "generate" or "embed": a model of the other kind is a 400 (None: any model). A further
        --served-model-name of a model reaches it, and answers carry the name the request used (as vLLM).
        `state` (a request's): its tenant must be allowed the model (403), and its ledger row names it."""
        if model in self.gateway.backends.models and model not in self.engines:
            raise InvalidRequestError(f"model {model!r} is served by remote backends, which only "
                                      "/v1/chat/completions and /v1/completions reach", param="model")
        adapter = find_adapter(self.engines, model) if model not in self.engines else None
        if adapter is not None:  # a LoRA adapter's name: its base model's engine, the adapter on every request
            name, engine = model, select_engine(self.engines, adapter[0], task)[1].with_adapter(adapter[1])
        elif model in self.aliases:
            name, engine = model, select_engine(self.engines, self.aliases[model], task)[1]
        else:
            name, engine = select_engine(self.engines, model, task)
        self.gateway.admit_local(state, name, self.aliases.get(name, name))
        return name, engine

    def model_names(self) -> list[str]:
        """Every model a client may name: local engines, their further names, remote-only models."""
        return [*self.engines, *self.aliases, *(m for m in self.gateway.backends.models if m not in self.engines)]

    def can_answer(self, name: str, endpoint: str) -> bool:
        """Whether a served model can answer this endpoint: a generating model, with a chat template for chat.
        A remote model is trusted to."""
        adapter = find_adapter(self.engines, name) if name not in self.engines else None
        engine = self.engines.get(adapter[0] if adapter is not None else self.aliases.get(name, name))
        if engine is None:
            return True
        if engine.task != "generate":
            return False
        return endpoint != "chat" or bool(engine.chat_template)

    async def route(self, model: str | None, text: str, state, endpoint: str = "completions") -> str | None:
        """The model a request goes to: the router's choice for model "auto" (gateway.route)."""
        return self.gateway.route(model, text, state, endpoint, lambda name: self.can_answer(name, endpoint))

    def check_fanout(self, engine: Served, num_prompts: int, n: int) -> None:
        """Prompts and sequences against the limits and the waiting queue, before any tokenizing."""
        check_fanout(self.limits, num_prompts, n, engine.stats().num_requests_waiting, engine.max_num_waiting)

    def params_for(self, engine: EngineClient, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """The one place a request's max_tokens is decided: unset, it gets the model's default (its generation
        config's max_new_tokens) or the server's, capped at what the context leaves (vLLM caps at the
        context); a prompt that leaves nothing is refused by the engine with its own message."""
        room = engine.max_model_len - num_prompt_tokens
        default = engine.default_sampling.get("max_tokens") or self.default_max_tokens
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


def create_app(engines: dict[str, Served], limits: LimitsConfig | None = None,
               default_max_tokens: int | None = ServerConfig.default_max_tokens,
               metrics_prefix: str = ServerConfig.metrics_prefix, region: str = "WLD",
               extra_routes: tuple = ()) -> FastAPI:
    """The API itself; `edge_stack` wraps it with auth, CORS, limits, request ids and the access log.
    `extra_routes`: `register(app, server)` functions of the layers above the server (the agents')."""
    server = OpenAIServer(engines, limits, default_max_tokens, metrics_prefix, region)
    app = FastAPI(title="sobrio", version=sobrio.__version__)
    app.state.server = server
    install_error_handlers(app)
    install_openapi(app)
    install_embedding_routes(app, server)
    routes.register(app, server)  # /health, /version, /metrics, /v1/models, chat, completions, usage, dashboard
    lora_routes.register(app, server)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    routes_tokenize.register(app, server)  # /tokenize, /detokenize, /v1/models/{id}, /ping
    responses_api.register(app, server)  # /v1/responses
    for register in extra_routes:
        register(app, server)
    return app


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
