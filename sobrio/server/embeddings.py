"""`POST /v1/embeddings` (OpenAI's shape, with vLLM's `truncate_prompt_tokens` and `add_special_tokens`).

An embedding model is an `EmbeddingClient` (sobrio/engine/client.py) in the server's engine table, beside
the generative `EngineClient`s: `/v1/models`, `/health` and `/metrics` list it like any model; chat and
completions on it are a 400, as embeddings on a generative model are.
"""

import asyncio
import base64
import time
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request, Response
from pydantic import Field

from sobrio.engine.client import Served
from sobrio.errors import InvalidRequestError, UnknownModelError
from sobrio.gateway.gate import reserve_tokens
from sobrio.ids import new_id
from sobrio.server.disconnect import unless_disconnected
from sobrio.server.limits import check_prompt_tokens
from sobrio.server.protocol import StrictModel, now

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request


class EmbeddingRequest(StrictModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=256)  # accepted, no effect
    # vLLM's
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True

    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(t, int) for t in value):
            return [list(value)]  # one input as token ids
        return list(value)


def select_engine(engines: dict[str, Served], model: str | None, task: str | None = None) -> tuple[str, Served]:
    """The served model `model` (None: the first of `task`); a model of the other kind is a 400 naming the API
    it lacks, as vLLM answers. `task`: "generate", "embed" or None (either)."""
    if not model:
        for name, engine in engines.items():
            if task is None or engine.task == task:
                return name, engine
        raise InvalidRequestError(f"no model served here supports the {_API[task]} API", param="model")
    if model not in engines:
        raise UnknownModelError(f"model {model!r} is not served here; served: {', '.join(engines)}")
    engine = engines[model]
    if task is not None and engine.task != task:
        raise InvalidRequestError(f"model {model!r} does not support the {_API[task]} API "
                                  f"(it is {'an embedding' if task == 'generate' else 'a generative'} model)",
                                  param="model")
    return model, engine


_API = {"generate": "Chat Completions and Completions", "embed": "Embeddings"}


def install_embedding_routes(app: FastAPI, server) -> None:
    """Register /v1/embeddings."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        arrival = time.monotonic()
        name, engine = server.engine_for(body.model, "embed", request.state)
        request_id = new_id("embd")
        request.state.request_id = request_id
        inputs = body.inputs()
        if len(inputs) > MAX_INPUTS:
            raise InvalidRequestError(f"input has {len(inputs)} items; at most {MAX_INPUTS}", param="input")
        if body.dimensions is not None and body.dimensions != engine.dimensions:
            raise InvalidRequestError(f"dimensions={body.dimensions} is not supported: model {name!r} has "
                                      f"{engine.dimensions} dimensions and no shorter (matryoshka) form",
                                      param="dimensions")
        rows = await asyncio.to_thread(engine.tokenize_inputs, inputs, body.truncate_prompt_tokens,
                                       body.add_special_tokens)
        check_prompt_tokens(server.limits, [len(r) for r in rows], 1)
        reserve_tokens(request.state, sum(len(r) for r in rows))
        vectors = await unless_disconnected(engine.embed(rows, arrival), request)
        if vectors is None:
            return Response(status_code=499)
        num_tokens = sum(len(r) for r in rows)
        if getattr(request.state, "ledger", None) is not None:
            request.state.ledger.prompt_tokens = num_tokens
        return {"id": request_id, "object": "list", "created": now(), "model": name,
                "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _encode(vector: np.ndarray, encoding_format: str):
    if encoding_format == "base64":  # little-endian float32, as OpenAI's (and its client decodes)
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
