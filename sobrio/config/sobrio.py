"""`SobrioConfig`: one engine's whole configuration, one concern per attribute, as vLLM's `VllmConfig`."""

import difflib
from dataclasses import dataclass, field, fields
from typing import Any

from sobrio.config.cache import CacheConfig
from sobrio.config.kv_transfer import KVTransferConfig
from sobrio.config.lora import LoRAConfig
from sobrio.config.model import ModelConfig
from sobrio.config.parallel import ParallelConfig
from sobrio.config.scheduler import SchedulerConfig
from sobrio.config.speculative import SpeculativeConfig
from sobrio.config.structured import StructuredOutputsConfig
from sobrio.config.unsupported import UnsupportedConfig
from sobrio.errors import ConfigError


@dataclass(frozen=True)
class SobrioConfig:
    """What one engine needs, and all that crosses to its engine-core process (it pickles)."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_transfer_config: KVTransferConfig = field(default_factory=KVTransferConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def concerns(cls) -> dict[str, type]:
        """Attribute name -> concern class, in declaration order."""
        return {f.name: f.type for f in fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "SobrioConfig":
        """vLLM's flat form (`LLM(model, max_num_seqs=8, block_size=16)`): each keyword goes to the concern
        that declares it; an unknown one raises ConfigError naming it (and the nearest known name), and one for
        a feature sobrio lacks (`enable_sleep_mode=True`) says so; those left at their default are dropped."""
        refused = {f.name for f in fields(UnsupportedConfig)}
        UnsupportedConfig(**{k: v for k, v in kwargs.items() if k in refused})
        kwargs = {k: v for k, v in kwargs.items() if k not in refused}
        owner = _owners()
        for name in kwargs:
            if name not in owner:
                raise ConfigError(_unknown(name, owner), name)
        parts = {attr: concern(**{k: v for k, v in kwargs.items() if owner[k] == attr})
                 for attr, concern in cls.concerns().items()}
        return cls(**parts)


def _owners() -> dict[str, str]:
    """Field name -> the SobrioConfig attribute whose concern declares it; names are unique across concerns."""
    owner: dict[str, str] = {}
    for attr, concern in SobrioConfig.concerns().items():
        for f in fields(concern):
            if f.name in owner:
                raise TypeError(f"config field {f.name} is declared by {owner[f.name]} and {attr}")
            owner[f.name] = attr
    return owner


def _unknown(name: str, owner: dict[str, str]) -> str:
    close = difflib.get_close_matches(name, owner, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown engine argument {name!r}{hint}"
