"""vLLM's `/tokenize` and `/detokenize`, OpenAI's `GET /v1/models/{id}`, and vLLM's `/ping`.

Tokenizing uses the engine's own input processor (the chat template and tokenizer requests go through), in
a worker thread: a long text never blocks the event loop, and no engine lock is taken.
"""

import asyncio
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError, model_validator

from sobrio.engine.client import Served
from sobrio.errors import InvalidRequestError, UnknownModelError
from sobrio.server.errors import error_response
from sobrio.server.protocol import ChatMessage, StrictModel, TokenId, now


class TokenizeCompletionRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(StrictModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.tools:
            raise InvalidRequestError("tools are not supported", param="tools")
        if self.continue_final_message:
            raise InvalidRequestError("continue_final_message is not supported", param="continue_final_message")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[TokenId]  # as many as the body limit (--max-body-bytes) lets through


def _parse(body: dict) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """vLLM's two forms, told apart by `messages`; errors name the field as every other route's do."""
    model = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def model_card(name: str, engine: Served) -> dict:
    return {"id": name, "object": "model", "created": now(), "owned_by": "sobrio",
            "max_model_len": engine.max_model_len}


def _tokenize(engine: Served, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
    processor = engine.input_processor
    if isinstance(req, TokenizeChatRequest):
        try:
            messages = [m.template_dict() for m in req.messages]
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="messages") from None
        ids = processor.chat_prompt_ids(messages, req.add_generation_prompt, template_kwargs=req.chat_template_kwargs,
                                        add_special_tokens=req.add_special_tokens)
    else:
        ids = processor.encode(req.prompt, req.add_special_tokens)
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
            "token_strs": processor.token_strs(ids) if req.return_token_strs else None}


def register(app: FastAPI, server) -> None:
    """Add these routes to the app of `create_app` (`server`: its OpenAIServer)."""

    # Behind the gateway's key check (gateway/gate.py), with the tenant's model restrictions (403).
    @app.post("/tokenize")
    async def tokenize(body: Annotated[dict[str, Any], Body()], request: Request):
        req = _parse(body)
        _, engine = server.engine_for(req.model, state=request.state)
        return await asyncio.to_thread(_tokenize, engine, req)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        _, engine = server.engine_for(body.model, state=request.state)
        return {"prompt": await asyncio.to_thread(engine.input_processor.decode, body.tokens)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        if model_id not in server.engines:  # not engine_for: an empty id must not mean "the first model"
            raise UnknownModelError(f"model {model_id!r} is not served here; served: {', '.join(server.engines)}")
        server.engine_for(model_id, state=request.state)  # the tenant may not use it: 403
        return model_card(model_id, server.engines[model_id])

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """vLLM's (SageMaker's) liveness probe: /health's answer."""
        down = [name for name, engine in server.engines.items() if not engine.healthy]
        if down:
            return error_response(503, f"engine unavailable: {', '.join(down)}", "server_error")
        return {"status": "ok"}

