"""The model runner's adapters: the base model's modules wrapped once, adapters read from disk when a step
first needs them and kept in memory up to `--max-cpu-loras` (least recently used evicted)."""

import logging
from collections import OrderedDict

import torch

from sobrio.config import SobrioConfig
from sobrio.errors import ConfigError
from sobrio.layers.lora import LoRAStep, attach_lora
from sobrio.loader.lora import LoRARequest, ReadBuffer, read_adapter, target_shapes
from sobrio.timing import log_step

logger = logging.getLogger(__name__)


def runner_adapters(config: SobrioConfig, model: torch.nn.Module, hf_config, dtype: torch.dtype
                    ) -> "RunnerAdapters | None":
    """The model's adapters under --enable-lora (None without). Refused where a step would compute tokens
    the adapter does not see: model drafts (a draft model, EAGLE head or early exit knows no adapter; n-gram
    drafts come from the text and are verified by the adapted model) and tensor-parallel shards (adapters
    are not split)."""
    lora = config.lora_config
    if not lora.enable_lora:
        return None
    method = config.speculative_config.get("method") if config.speculative_config.enabled else None
    if method not in (None, "ngram"):
        raise ConfigError(f"--enable-lora with --speculative-config method {method!r}: its drafts would come from a "
                          "model without the request's adapter; with LoRA only ngram (prompt lookup) speculates, "
                          "the verifying forward applies the adapter", "--enable-lora")
    if config.parallel_config.tensor_parallel_size > 1:
        raise ConfigError("--enable-lora with --tensor-parallel-size > 1: adapters are not sharded yet",
                          "--enable-lora")
    return RunnerAdapters(model, hf_config, dtype, lora.max_lora_rank, lora.resident)


class RunnerAdapters:
    """Owns the LoRA state of one model: which adapters are resident, and the current step's groups."""

    def __init__(self, model: torch.nn.Module, hf_config, dtype: torch.dtype, max_rank: int, max_resident: int):
        self.decoder = model.model
        self.fused_decode = self.decoder.fused_decode  # off in a step with an adapter: it has no LoRA products
        self.shapes = target_shapes(hf_config)
        self.step = LoRAStep(max_resident)
        self.num_layers = len(self.decoder.layers)
        self.banks = attach_lora(self.decoder.layers, self.shapes, self.step, dtype)
        self.max_rank, self.max_resident = max_rank, max_resident
        self.resident: OrderedDict[int, int] = OrderedDict()  # id -> slot, least recently used first
        self.read_buffer = ReadBuffer()  # one adapter's bytes and stacks, read after read into the same pages
        self.free = list(range(max_resident - 1, -1, -1))  # slots no adapter holds (popped from the end)

    def prepare(self, adapters: list[LoRARequest | None], lengths: list[int]) -> None:
        """Before a step's forward: each request's adapter resident, the tokens grouped by adapter slot."""
        needed = list(dict.fromkeys(a for a in adapters if a is not None))
        for adapter in needed:  # the step's resident adapters last in line for eviction, before any load
            if adapter.lora_int_id in self.resident:
                self.resident.move_to_end(adapter.lora_int_id)
        for adapter in needed:
            self._ensure(adapter)
        self.step.set([None if a is None else self.resident[a.lora_int_id] for a in adapters], lengths)
        self.decoder.fused_decode = None if self.step.rows is not None else self.fused_decode

    def _ensure(self, adapter: LoRARequest) -> None:
        """Read the adapter from disk into a free slot (evicting the least recently used adapter if none is),
        each target's stacked pairs straight into the slot; a read that fails leaves the slot empty."""
        if adapter.lora_int_id in self.resident:
            return
        if not self.free:
            self._evict(next(iter(self.resident)))
        slot = self.free[-1]
        with log_step(logger, "loading LoRA adapter %s", adapter.lora_name):
            try:
                scaling, stacks = read_adapter(adapter.lora_path, self.max_rank, self.num_layers, self.shapes,
                                               self.read_buffer)
                for target, (a, b) in stacks.items():  # every layer's pair of a target in one go
                    self.banks[target].add(slot, target, a, b, scaling)
            except BaseException:
                self._clear(slot)
                raise
        self.resident[adapter.lora_int_id] = self.free.pop()

    def _evict(self, adapter_id: int) -> None:
        slot = self.resident.pop(adapter_id)
        self._clear(slot)
        self.free.append(slot)

    def _clear(self, slot: int) -> None:
        for bank in dict.fromkeys(self.banks.values()):
            bank.remove(slot)
