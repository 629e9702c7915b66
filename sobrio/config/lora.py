"""LoRA adapters over the served model (vLLM's flags): which may be served, how many at once."""

import json
from dataclasses import dataclass

from sobrio.config.fields import Checked, flag
from sobrio.errors import ConfigError


@dataclass(frozen=True)
class LoRAConfig(Checked):
    """`--enable-lora` and its limits; `--lora-modules` names the adapters registered at start-up."""

    enable_lora: bool = flag(False, "serve LoRA adapters (PEFT folders) over the model: a request names one as its "
                                    "model")
    lora_modules: list[str] | None = flag(None, "adapters to register at start-up: name=path, or JSON "
                                                '\'{"name": ..., "path": ..., "base_model_name": ...}\'', nargs="+")
    max_loras: int = flag(1, "adapters one step may compute (requests of further adapters wait)")
    max_lora_rank: int = flag(16, "the largest adapter rank accepted")
    max_cpu_loras: int | None = flag(None, "adapters kept in memory, least recently used evicted (default: "
                                           "--max-loras)")

    def __post_init__(self) -> None:
        self._require("max_loras", self.max_loras >= 1, ">= 1")
        self._require("max_lora_rank", self.max_lora_rank >= 1, ">= 1")
        self._require("max_cpu_loras", self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                      f">= --max-loras ({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora", "--lora-modules")
        self.modules()  # a malformed entry fails now

    @property
    def resident(self) -> int:
        return self.max_cpu_loras or self.max_loras

    def modules(self) -> list[tuple[str, str, str | None]]:
        """(name, path, base model name or None) of each --lora-modules entry."""
        out = []
        for entry in self.lora_modules or []:
            if entry.lstrip().startswith("{"):
                try:
                    obj = json.loads(entry)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"--lora-modules: not valid JSON ({exc.msg}): {entry!r}",
                                      "--lora-modules") from None
                if not isinstance(obj, dict) or not obj.get("name") or not obj.get("path"):
                    raise ConfigError(f"--lora-modules: a JSON entry needs name and path: {entry!r}", "--lora-modules")
                out.append((obj["name"], obj["path"], obj.get("base_model_name")))
            elif "=" in entry and entry.split("=", 1)[0] and entry.split("=", 1)[1]:
                name, path = entry.split("=", 1)
                out.append((name, path, None))
            else:
                raise ConfigError(f"--lora-modules: expected name=path or a JSON object, got {entry!r}",
                                  "--lora-modules")
        return out
