"""vLLM flags for features sobrio lacks. They parse, so a vLLM script fails with "sobrio does not support --X yet"
(exit 2) instead of argparse's "unrecognized arguments"; a value equal to the default (a no-op) is accepted.

`SobrioConfig.from_kwargs` checks them too, so `LLM(model, enable_sleep_mode=True)` says the same. The config
holds nothing once checked: it never crosses to an engine core.
"""

from dataclasses import dataclass

from sobrio.config.fields import Checked, unsupported


@dataclass(frozen=True)
class UnsupportedConfig(Checked):
    """vLLM flags sobrio recognizes but does not support yet: any value but the default is refused (exit 2)."""

    load_format: str = unsupported("auto", "weight formats other than safetensors and GGUF (auto)")
    revision: str | None = unsupported(None, "model revisions (models resolve offline, from local files)")
    enable_expert_parallel: bool = unsupported(False, "expert parallelism (a mixture of experts runs all its "
                                                      "experts in one process)")
    kv_events_config: str | None = unsupported(None, "KV-cache events")
    cpu_offload_gb: float = unsupported(0.0, "weight offloading (the weights are in CPU memory already)")
    enable_sleep_mode: bool = unsupported(False, "sleep mode")
    limit_mm_per_prompt: str | None = unsupported(None, "multimodal inputs")
    reasoning_parser: str | None = unsupported(None, "reasoning parsers")

    def __post_init__(self) -> None:
        self._refuse_unsupported()
