"""One generation request (chat or completion) from its prompts' token ids to its answer: sampling defaults,
submission, then one JSON answer or a stream of server-sent events; and the same request handed to a
remote replica when the gateway chooses one."""

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from sobrio.engine.client import EngineClient
from sobrio.engine.outputs import RequestOutput
from sobrio.errors import EngineStepError, InvalidRequestError, SobrioError
from sobrio.gateway.backends import prefix_hashes
from sobrio.gateway.gate import cache_salt, reserve_tokens
from sobrio.gateway.gateway import RemoteCall
from sobrio.gateway.ledger import LedgerEntry
from sobrio.ids import new_id
from sobrio.server import tool_calls
from sobrio.server.budgets import remote_worst_case
from sobrio.server.disconnect import unless_disconnected
from sobrio.server.errors import error_response, log_unexpected, sobrio_error_response
from sobrio.server.limits import check_prompt_tokens
from sobrio.server.protocol import ignored_fields, log_ignored, now
from sobrio.server.responses import ChoiceState, chat_chunk, completion_chunk, final_response, note_usage, usage_of
from sobrio.types.params import SamplingParams


@dataclasses.dataclass
class Generation:
    """A request's parts the answer needs besides its prompts."""

    body: object  # ChatCompletionRequest or CompletionRequest
    params: SamplingParams
    model_name: str  # as the request named it
    engine: EngineClient
    kind: str  # "chat" or "completion"
    echo: list[str] | None = None
    tool_plan: tool_calls.ToolPlan | None = None


async def respond(server, request: Request, gen: Generation, prompts: list[list[int]]):
    """Submit one engine request per prompt and answer: a JSON body, or a stream (`body.stream`)."""
    body, engine = gen.body, gen.engine
    check_prompt_tokens(server.limits, [len(p) for p in prompts], gen.params.n)
    params = with_model_defaults(gen.params, body, engine.default_sampling)
    per_prompt = [server.params_for(engine, params, len(p)) for p in prompts]
    base_id = new_id("chatcmpl" if gen.kind == "chat" else "cmpl")
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
        raise InvalidRequestError(str(exc), param="tools" if gen.tool_plan is not None else "response_format") \
            from None
    stream = engine.stream_outputs(request_ids, params.n, queue)
    choices = ChoiceState(request_ids, params.n, params.logprobs, gen.echo, params.prompt_logprobs,
                          engine.input_processor.decode)
    choices.tool_calls = gen.tool_plan is not None
    choices.forced_tool_calls = gen.tool_plan is not None and gen.tool_plan.choice != "auto"
    entry = getattr(request.state, "ledger", None)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        sse = _sse(stream, choices, base_id, gen.model_name, gen.kind, include_usage, entry)
        return StreamingResponse(sse, media_type="text/event-stream")
    failed = await gather_into(choices, stream, request, entry, EngineStepError)
    return failed if failed is not None else final_response(choices, base_id, gen.model_name, gen.kind)


async def gather_into(choices: ChoiceState, stream: AsyncIterator[RequestOutput], request: Request,
                      entry: LedgerEntry | None, caught: type[SobrioError] = SobrioError) -> Response | None:
    """Every output of a non-streamed request into `choices`, its usage into its ledger row; the answer
    instead when there is none to give: the error's (`caught`), or 499 when the client left first."""
    try:
        outputs = await collect_unless_disconnected(stream, request)
    except caught as exc:
        return sobrio_error_response(exc)
    if outputs is None:
        return Response(status_code=499)
    for output in outputs:
        choices.add(output)
    note_usage(entry, choices)
    return None


async def via_remote(server, model: str | None, endpoint: str, body, request: Request):
    """The answer of a remote replica when the model has remote ones and one is chosen (a failure before
    its first byte retried once on another); None when the local engine takes the request."""
    gateway = server.gateway
    if not model and not server.engines:  # a gateway of remote backends only: its first model
        model = next(iter(gateway.backends.models))
    pool = gateway.remote_pool(server.aliases.get(model, model) if model else None)
    if pool is None:
        return None  # local engines only: as without a gateway configuration
    state = request.state
    tenant = gateway.admit(state, model, pool.model)
    state.request_id = new_id("chatcmpl" if endpoint.startswith("chat") else "cmpl")
    reserve_tokens(state, remote_worst_case(body, server.default_max_tokens))
    call = RemoteCall(body.model_dump(mode="json", exclude_unset=True), cache_salt(state, body.cache_salt),
                      bool(body.stream), bool(body.stream_options and body.stream_options.include_usage),
                      prefix_hashes(affinity_text(body)), tenant, getattr(state, "ledger", None),
                      lambda answer: _unless_gone(answer, request))
    return await gateway.forward(pool, model, endpoint, call)


async def _unless_gone(answer, request: Request):
    """The remote answer, or 499 when the client left first."""
    result = await unless_disconnected(answer, request)
    return Response(status_code=499) if result is None else result


def affinity_text(body) -> str:
    """The text a remote replica's prefix affinity looks at: the conversation, or the first prompt."""
    if hasattr(body, "messages"):
        return "".join(f"{m.role}\n{m.content}\n" for m in body.messages if isinstance(m.content, str))
    prompts = body.prompts()
    return prompts[0] if prompts and isinstance(prompts[0], str) else ""


def with_model_defaults(params: SamplingParams, body, defaults: dict) -> SamplingParams:
    """The model's default sampling parameters (--generation-config) for the fields the request left unset
    (max_tokens apart: `OpenAIServer.params_for` decides it, once)."""
    unset = {k: v for k, v in defaults.items() if k != "max_tokens" and getattr(body, k, 0) is None}
    return dataclasses.replace(params, **unset) if unset else params


def echo_texts(engine: EngineClient, prompts: list) -> list[str]:
    """What `echo` puts before each completion: the prompt as sent, or its token ids as text."""
    return [p if isinstance(p, str) else engine.input_processor.decode(p, "prompt") for p in prompts]


async def collect_unless_disconnected(stream: AsyncIterator[RequestOutput], request: Request):
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
            chunk = make_chunk(choices, choices.add(output), output, base_id, model_name, created)
            if include_usage:
                chunk["usage"] = None
            yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage:
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            final = {"id": base_id, "object": obj, "created": created, "model": model_name, "choices": [],
                     "usage": usage_of(choices).model_dump()}
            yield f"data: {json.dumps(final)}\n\n"
    except SobrioError as exc:
        yield _error_event(sobrio_error_response(exc), entry)
    except Exception as exc:  # noqa: BLE001 - a bug mid-stream: say so in the stream, log no message
        log_unexpected(exc, "stream")
        yield _error_event(error_response(500, "internal server error", "server_error"), entry)
    finally:
        note_usage(entry, choices)
        await stream.aclose()
    yield "data: [DONE]\n\n"


def _error_event(error: Response, entry: LedgerEntry | None) -> str:
    if entry is not None:
        entry.status = error.status_code
    return f"data: {json.dumps(json.loads(error.body))}\n\n"
