"""`POST /v1/responses`: OpenAI's Responses API for text in and text out, streamed or not.

Input is a string or a list of messages with text content; `instructions` becomes a system message; the
output is one assistant message with one `output_text` part. The events of a stream are OpenAI's
(response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done,
response.output_item.done, response.completed), as `event: <type>` / `data: <json>` pairs with a
`sequence_number`; like vLLM, a response cut by `max_output_tokens` ends with response.completed whose
status is "incomplete". Nothing is stored: `store` is accepted and ignored, `previous_response_id` is
refused. Structured output is `text.format` (`{"type": "json_schema", "name", "schema", "strict"}` or
`{"type": "json_object"}`), enforced while decoding exactly as chat's `response_format`, and echoed in the
response's `text`. Tools, background runs and logprobs are refused as not supported.
"""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, field_validator, model_validator

from sobrio.engine.outputs import RequestOutput
from sobrio.errors import InvalidRequestError, SobrioError
from sobrio.gateway.gate import cache_salt
from sobrio.ids import new_id
from sobrio.server.errors import log_unexpected, sobrio_error_response
from sobrio.server.generate import gather_into
from sobrio.server.limits import check_prompt_tokens
from sobrio.server.protocol import Priority, StrictModel, given, log_ignored, logit_bias_ids, now
from sobrio.server.responses import ChoiceState, note_usage
from sobrio.types.params import INT32_MAX, MAX_LOGIT_BIAS, SamplingParams, StructuredOutputsParams

TEXT_PARTS = ("input_text", "output_text", "text")
# accepted, no effect (no storage, no tools, no reasoning models): logged by name at DEBUG
RESPONSES_IGNORED = ("store", "metadata", "service_tier", "user", "safety_identifier", "prompt_cache_key",
                     "parallel_tool_calls", "reasoning", "stream_options", "truncation")


class InputMessage(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None  # an earlier output item sent back as input
    status: str | None = None

    def chat_dict(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p["text"] for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class TextFormat(StrictModel):
    """OpenAI's `text.format`: plain text, any JSON object, or JSON that validates against `schema` (enforced
    while decoding, `strict` or not, as chat's `response_format`)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")  # `schema` would shadow pydantic's
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("text.format of type json_schema needs a schema")
        given = [name for name, field in (("name", "name"), ("description", "description"),
                                          ("schema", "json_schema"), ("strict", "strict"))
                 if getattr(self, field) is not None]
        if self.type != "json_schema" and given:
            raise ValueError(f"text.format of type {self.type} takes no {', '.join(given)}")
        return self

    def structured(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema)
        return None

    def echo(self) -> dict:
        """As OpenAI's response repeats it."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name or "response", "description": self.description,
                "schema": self.json_schema, "strict": self.strict}


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ReasoningConfig(StrictModel):
    effort: str | None = Field(default=None, max_length=32)
    summary: str | None = Field(default=None, max_length=32)
    generate_summary: str | None = Field(default=None, max_length=32)


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = None


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    text: TextConfig | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_messages_only(cls, value):
        """Say "not supported" for items sobrio cannot take (function calls, images, files), before the union
        of input shapes reports them as a mere type mismatch."""
        for item in value if isinstance(value, list) else ():
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                raise ValueError("only message items are supported; other input items are not supported")
            content = item.get("content")
            for part in content if isinstance(content, list) else ():
                if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
                    raise ValueError("only text content parts (input_text, output_text) are supported; "
                                     "other content is not supported")
        return value
    # honoured only in their no-op form; anything else is refused as not supported
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None
    # accepted and ignored
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None  # no served model reasons
    # vLLM's extensions
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    priority: Priority = 0
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refuse_what_changes_the_answer(self):
        refused = {
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "auto", "none"),
            "previous_response_id": self.previous_response_id is not None,
            "background": bool(self.background),
            "include": bool(self.include),
            "top_logprobs": bool(self.top_logprobs),
            "truncation": self.truncation == "auto",
        }
        for name, bad in refused.items():
            if bad:
                raise InvalidRequestError(f"{name} is not supported by sobrio's Responses API (text in, text out; "
                                          "nothing is stored)", param=name)
        if isinstance(self.input, list) and not self.input:
            raise InvalidRequestError("input is empty", param="input")
        return self

    def ignored_fields(self) -> list[str]:
        return [name for name in RESPONSES_IGNORED if name in self.model_fields_set]

    def messages(self) -> list[dict]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        return messages + [m.chat_dict() for m in self.input]

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            **given(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty or None), max_tokens=self.max_output_tokens,
            logit_bias=logit_bias_ids(self.logit_bias), structured_outputs=self.structured())

    def structured(self) -> StructuredOutputsParams | None:
        return self.text.format.structured() if self.text and self.text.format else None

    def text_echo(self) -> dict:
        return {"format": self.text.format.echo() if self.text and self.text.format else {"type": "text"}}


def _usage(state: ChoiceState) -> dict:
    prompt = sum(state.prompt_tokens.values())
    completion = sum(len(c.token_ids) for c in state.choices.values())
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": sum(state.cached_tokens.values()), "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(msg_id: str, text: str | None, status: str) -> dict:
    return {"type": "message", "id": msg_id, "role": "assistant", "status": status,
            "content": [] if text is None else [_text_part(text)]}


class _Reply:
    """One response's ids and the fields every snapshot of it repeats."""

    def __init__(self, body: ResponsesRequest, model_name: str):
        self.body = body
        self.model_name = model_name
        self.id = new_id("resp").replace("-", "_", 1)
        self.msg_id = new_id("msg").replace("-", "_", 1)
        self.created_at = now()

    def snapshot(self, status: str, output: list[dict], state: ChoiceState | None = None,
                 finish_reason: str | None = None) -> dict:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        if incomplete and status == "completed":
            status = "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None, "incomplete_details": incomplete, "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "max_tool_calls": None, "model": self.model_name,
            "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "service_tier": "default", "store": False,
            "temperature": SamplingParams.temperature if b.temperature is None else b.temperature,
            "text": b.text_echo(), "tool_choice": b.tool_choice if isinstance(b.tool_choice, str) else "auto",
            "tools": [], "top_logprobs": 0, "top_p": SamplingParams.top_p if b.top_p is None else b.top_p,
            "truncation": "disabled",
            "usage": _usage(state) if state is not None else None, "user": b.user, "metadata": b.metadata or {},
        }


def register(app: FastAPI, server) -> None:
    """Add `POST /v1/responses` to the app of `create_app`: `server` is its OpenAIServer."""
    error_response = sobrio_error_response

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        name, engine = server.engine_for(body.model, "generate", request.state)
        params = body.to_sampling_params()
        server.check_fanout(engine, 1, 1)
        messages = body.messages()
        ids = await asyncio.to_thread(engine.input_processor.chat_prompt_ids, messages, True,
                                      template_kwargs=body.chat_template_kwargs)
        check_prompt_tokens(server.limits, [len(ids)], 1)
        params = server.params_for(engine, params, len(ids))
        reply = _Reply(body, name)
        request.state.request_id = reply.id
        log_ignored(body.ignored_fields(), reply.id)
        queue: asyncio.Queue = asyncio.Queue()
        try:
            salt = cache_salt(request.state, body.cache_salt)
            request_ids = await server.submit(engine, reply.id, [ids], [params], salt, queue, body.priority,
                                              request.state)
        except InvalidRequestError as exc:  # a bad schema: name the field this API gave it in
            if exc.param != "structured_outputs":
                raise
            raise InvalidRequestError(str(exc), param="text.format") from None
        stream = engine.stream_outputs(request_ids, 1, queue)
        state = ChoiceState(request_ids, 1, None)
        if body.stream:
            events = _events(stream, state, reply, error_response, getattr(request.state, "ledger", None))
            return StreamingResponse(events, media_type="text/event-stream")
        failed = await gather_into(state, stream, request, getattr(request.state, "ledger", None))
        if failed is not None:
            return failed
        choice = state.choices[0]
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        return reply.snapshot("completed", [_message(reply.msg_id, choice.text, status)], state, choice.finish_reason)


def _sse(event: dict, seq: list[int]) -> str:
    event["sequence_number"] = seq[0]
    seq[0] += 1
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def _events(stream: AsyncIterator[RequestOutput], state: ChoiceState, reply: _Reply,
                  error_response, entry=None) -> AsyncIterator[str]:
    """The stream's events; a failure mid-way ends it with an `error` event (OpenAI's shape). The ledger row
    (`entry`) gets the tokens streamed, however the stream ends."""
    seq = [0]
    where = {"item_id": reply.msg_id, "output_index": 0, "content_index": 0}
    try:
        start = reply.snapshot("in_progress", [])
        yield _sse({"type": "response.created", "response": start}, seq)
        yield _sse({"type": "response.in_progress", "response": start}, seq)
        yield _sse({"type": "response.output_item.added", "output_index": 0,
                    "item": _message(reply.msg_id, None, "in_progress")}, seq)
        yield _sse({"type": "response.content_part.added", **where, "part": _text_part("")}, seq)
        async for output in stream:
            state.add(output)
            if output.delta_text:
                yield _sse({"type": "response.output_text.delta", **where, "delta": output.delta_text,
                            "logprobs": []}, seq)
        choice = state.choices[0]
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        yield _sse({"type": "response.output_text.done", **where, "text": choice.text, "logprobs": []}, seq)
        yield _sse({"type": "response.content_part.done", **where, "part": _text_part(choice.text)}, seq)
        item = _message(reply.msg_id, choice.text, status)
        yield _sse({"type": "response.output_item.done", "output_index": 0, "item": item}, seq)
        final = reply.snapshot("completed", [item], state, choice.finish_reason)
        yield _sse({"type": "response.completed", "response": final}, seq)
    except SobrioError as exc:
        answer = error_response(exc)
        if entry is not None:
            entry.status = answer.status_code
        error = json.loads(answer.body)["error"]
        yield _sse({"type": "error", "code": error["code"] or error["type"], "message": error["message"],
                    "param": error["param"]}, seq)
    except Exception as exc:  # noqa: BLE001 - a bug mid-stream: say so in the stream, log no message
        log_unexpected(exc, "responses stream")
        yield _sse({"type": "error", "code": "server_error", "message": "internal server error", "param": None}, seq)
    finally:
        note_usage(entry, state)
        await stream.aclose()
