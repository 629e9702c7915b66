"""The OpenAI routes of the server (chat, completions, models) and its own (health, version, metrics, usage,
dashboard). Each reads the request, asks the server for a model and the gateway for what it owns, and hands
generation to `generate.respond`."""

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import sobrio
from sobrio.errors import InvalidRequestError, SobrioError
from sobrio.server import tool_calls
from sobrio.server.errors import error_response, sobrio_error_response
from sobrio.server.generate import Generation, echo_texts, respond, via_remote
from sobrio.server.lora_routes import adapter_cards
from sobrio.server.protocol import ChatCompletionRequest, CompletionRequest, now


def register(app: FastAPI, server) -> None:
    """Add these routes to the app of `create_app` (`server`: its OpenAIServer)."""
    register_service_routes(app, server)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        users = [m.content for m in body.messages if m.role == "user" and isinstance(m.content, str)]
        model = await server.route(body.model, users[-1] if users else "", request.state, "chat")
        remote = await via_remote(server, model, "chat/completions", body, request)
        if remote is not None:
            return remote
        name, engine = server.engine_for(model, "generate", request.state)
        tool_plan = tool_calls.plan(body.tools, body.tool_choice, body.parallel_tool_calls)
        params = tool_calls.with_tool_grammar(body.to_sampling_params(), tool_plan)
        server.check_fanout(engine, 1, params.n)
        try:
            messages = [m.template_dict() for m in body.messages]
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="messages") from None
        messages, template_tools = tool_calls.prompt(messages, body.tools, tool_plan, engine.chat_template)
        ids = await asyncio.to_thread(engine.input_processor.chat_prompt_ids, messages, body.add_generation_prompt,
                                      template_kwargs=body.chat_template_kwargs, tools=template_tools)
        return await respond(server, request, Generation(body, params, name, engine, "chat", tool_plan=tool_plan),
                             [ids])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = body.prompts()
        text = prompts[0] if prompts and isinstance(prompts[0], str) else ""
        model = await server.route(body.model, text, request.state)
        remote = await via_remote(server, model, "completions", body, request)
        if remote is not None:
            return remote
        name, engine = server.engine_for(model, "generate", request.state)
        params = body.to_sampling_params()
        server.check_fanout(engine, len(prompts), params.n)
        tokenize = engine.input_processor.tokenize
        ids = await asyncio.to_thread(lambda: [tokenize(p) for p in prompts])
        echo = await asyncio.to_thread(echo_texts, engine, prompts) if body.echo else None
        return await respond(server, request, Generation(body, params, name, engine, "completion", echo), ids)


def register_service_routes(app: FastAPI, server) -> None:
    """What is not a model call: probes, metrics, the model list, usage and the dashboard."""

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
        return {"object": "list", "data": model_cards(server, getattr(request.state, "tenant", None))}

    @app.get("/v1/usage")
    async def usage(request: Request, since: float = 0.0, limit: int = 100):
        """The caller's own ledger rows (newest first) and totals since `since` (epoch seconds): a tenant's
        key sees its tenant's, the operator's key (or no key on an open server) the requests without one."""
        return server.gateway.usage(getattr(request.state, "tenant", None), since, limit)

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard(request: Request, key: str | None = None):
        """The operator's page (gateway/dashboard.py): the server's --api-key as a Bearer header or ?key=."""
        try:
            return HTMLResponse(server.gateway.dashboard(key, request.headers.get("authorization", "")))
        except SobrioError as exc:
            return sobrio_error_response(exc)


def model_cards(server, tenant) -> list[dict]:
    """/v1/models' entries: local models (and their further names), remote-only ones, LoRA adapters; for a
    tenant limited to some models, those it may use."""
    names = [(name, name) for name in server.engines] + list(server.aliases.items())
    data = [{"id": name, "object": "model", "created": now(), "owned_by": "sobrio", "root": main,
             "max_model_len": server.engines[main].max_model_len} for name, main in names]
    data += [{"id": name, "object": "model", "created": now(), "owned_by": "sobrio", "root": name}
             for name in server.gateway.backends.models if name not in server.engines]
    data += adapter_cards(server.engines, now())
    allowed = tenant.limits if tenant is not None else None
    if allowed is not None and allowed.allowed_models is not None:
        data = [m for m in data if {m["id"], m["root"]} & set(allowed.allowed_models)]
    return data
