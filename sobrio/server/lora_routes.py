"""vLLM's LoRA endpoints and model names: a request names an adapter as its `model`; `/v1/models` lists each
adapter with its `parent`; `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` change them at run time,
for the operator only (the server's --api-key, or an open server without tenants; never a tenant's key)."""

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from sobrio.engine.client import AdapterRegistry, Served
from sobrio.errors import InvalidRequestError, PermissionDeniedError
from sobrio.loader.lora import LoRARequest
from sobrio.server.protocol import StrictModel


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None  # which served model, where several take adapters
    load_inplace: bool = False  # vLLM's: replace an adapter of that name


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name is enough here


def registry_of(engine: Served) -> AdapterRegistry | None:
    """A generative model's adapter registry (None for an embedding model)."""
    return engine.adapters if engine.task == "generate" else None


def find_adapter(engines: dict, model: str | None) -> tuple[str, LoRARequest] | None:
    """(the served model, the adapter) that `model` names, or None."""
    for name, engine in engines.items():
        registry = registry_of(engine)
        lora = registry.get(model) if registry is not None else None
        if lora is not None:
            return name, lora
    return None


def adapter_names(engines: dict) -> list[str]:
    """The names of the adapters registered now (`--lora-modules`, loaded ones)."""
    return [name for engine in engines.values() if (registry := registry_of(engine)) is not None
            for name in registry.adapters]


def adapter_cards(engines: dict, created: int) -> list[dict]:
    """/v1/models entries of the adapters, as vLLM lists them (root: the folder; parent: the base model)."""
    cards = []
    for name, engine in engines.items():
        registry = registry_of(engine)
        for adapter in (registry.adapters.values() if registry is not None else []):
            cards.append({"id": adapter.request.lora_name, "object": "model", "created": created,
                          "owned_by": "sobrio", "root": adapter.request.lora_path, "parent": adapter.parent or name,
                          "max_model_len": engine.max_model_len})
    return cards


def register(app: FastAPI, server) -> None:
    def _operator_only(request: Request) -> None:
        if getattr(request.state, "tenant", None) is not None:
            raise PermissionDeniedError("loading and unloading LoRA adapters needs the operator's key (--api-key)",
                                        param="lora_name", code="operator_only")

    def _registry(base: str | None):
        enabled = {name: registry_of(e) for name, e in server.engines.items()
                   if registry_of(e) is not None and registry_of(e).config.enable_lora}
        if base is not None:
            if base not in enabled:
                raise InvalidRequestError(f"base_model_name {base!r} is no served model with --enable-lora",
                                          param="base_model_name")
            return enabled[base]
        if len(enabled) != 1:
            raise InvalidRequestError("LoRA adapters need a model served with --enable-lora" if not enabled else
                                      "several models take adapters: name one as base_model_name",
                                      param="base_model_name")
        return next(iter(enabled.values()))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
        _operator_only(request)
        if body.lora_name in server.model_names() or find_adapter(server.engines, body.lora_name) and \
                not body.load_inplace:
            raise InvalidRequestError(f"the name {body.lora_name!r} is already served", param="lora_name")
        registry = _registry(body.base_model_name)
        if body.load_inplace and registry.get(body.lora_name) is not None:
            registry.unregister(body.lora_name)
        await asyncio.to_thread(registry.register, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
        _operator_only(request)
        found = find_adapter(server.engines, body.lora_name)
        if found is None:
            raise InvalidRequestError(f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name")
        registry_of(server.engines[found[0]]).unregister(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
