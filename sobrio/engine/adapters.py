"""The front's LoRA adapters: names a request may use as its model, each checked once when registered.

Registering checks the PEFT folder (its config, and its tensors' names and shapes from the safetensors
header, no tensor read) against the base model, so a request never reaches the engine core with an adapter
it would fail to load; the engine core reads the tensors once, when a step first needs the adapter. Each
registration gets a new id (`LoRARequest.lora_int_id`): an adapter unloaded and loaded again under its name
shares no KV blocks or resident weights with the old one.
"""

import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

from sobrio.config.lora import LoRAConfig
from sobrio.errors import ConfigError, InvalidRequestError, UnknownModelError
from sobrio.loader.lora import LoRARequest, check_adapter, target_shapes


@dataclass(frozen=True)
class Adapter:
    request: LoRARequest
    parent: str | None  # --lora-modules' base_model_name, or None: the served model


class AdapterRegistry:
    def __init__(self, config: LoRAConfig, hf_config):
        self.config = config
        self.hf_config = hf_config
        self.adapters: dict[str, Adapter] = {}
        self._checked: set[LoRARequest] = set()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the HTTP endpoints may register from several threads

    def register_modules(self) -> None:
        """--lora-modules, at start-up: a folder it refuses is a ConfigError naming the flag."""
        for name, path, parent in self.config.modules():
            try:
                self.register(name, path, parent)
            except InvalidRequestError as exc:
                raise ConfigError(f"--lora-modules {name}: {exc}", "--lora-modules") from None

    def register(self, name: str, path: str, parent: str | None = None) -> LoRARequest:
        """Check the folder and register it under `name` (InvalidRequestError if it is taken or refused)."""
        self._require_enabled()
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise InvalidRequestError("lora_name and lora_path must be non-empty strings", param="lora_name")
        with self._lock:
            if name in self.adapters:
                raise InvalidRequestError(f"the LoRA adapter {name!r} is already loaded", param="lora_name")
            request = LoRARequest(name, next(self._ids), str(Path(path).resolve()))
            self.check(request)
            self.adapters[name] = Adapter(request, parent)
        return request

    def unregister(self, name: str) -> None:
        with self._lock:
            if self.adapters.pop(name, None) is None:
                raise UnknownModelError(f"no LoRA adapter named {name!r} is loaded")

    def get(self, name: str | None) -> LoRARequest | None:
        adapter = self.adapters.get(name) if name else None
        return None if adapter is None else adapter.request

    def check(self, request: LoRARequest) -> None:
        """Check the adapter once against the base model; a request with one already checked passes at once."""
        self._require_enabled()
        if request in self._checked:
            return
        check_adapter(request.lora_path, self.config.max_lora_rank, self.hf_config.num_hidden_layers,
                      target_shapes(self.hf_config))
        self._checked.add(request)

    def _require_enabled(self) -> None:
        if not self.config.enable_lora:
            raise InvalidRequestError("LoRA adapters need a server started with --enable-lora", param="model")
