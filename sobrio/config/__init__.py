"""Configuration, one dataclass per concern, in vLLM's names and split (vLLM's `vllm/config/`).

- `ModelConfig` (model.py): what runs and how it computes: model, tokenizer, chat_template, the default
  sampling parameters (generation_config), dtype, quantization, max_model_len, max_logprobs, seed,
  attention_backend, batch_invariant (kernel choices, so the model's).
- `CacheConfig` (cache.py): the paged KV cache: block_size, kv_cache_memory (and its fraction and cap
  when unset), enable_prefix_caching; gpu_memory_utilization is accepted for vLLM's scripts (no effect).
- `SchedulerConfig` (scheduler.py): what one step may hold: max_num_seqs, max_num_batched_tokens,
  max_num_waiting (the waiting queue the scheduler drains), and the prefill policy
  (long_prefill_token_threshold, max_num_partial_prefills, max_long_partial_prefills);
  enable_chunked_prefill is accepted for vLLM's scripts (always on).
- `StructuredOutputsConfig` (structured.py): the grammar compile timeout and fast-forward (forced tokens
  emitted without sampling).
- `ParallelConfig` (parallel.py): num_threads, tensor_parallel_size, data_parallel_size,
  distributed_executor_backend (mp or ray); pipeline_parallel_size accepts only 1.
- `KVTransferConfig` (kv_transfer.py): `--kv-transfer-config`, disaggregated prefill and decode.
- `SpeculativeConfig` (speculative.py): `--speculative-config`, vLLM's JSON object (method, draft tokens,
  prompt-lookup n-gram sizes, disable_by_batch_size), checked once.
- `LoRAConfig` (lora.py): `--enable-lora`, `--lora-modules`, `--max-loras`, `--max-lora-rank`, `--max-cpu-loras`.
- `UnsupportedConfig` (unsupported.py): vLLM flags for features sobrio lacks (`--enable-sleep-mode`,
  `--kv-transfer-config`, ...): recognized, and refused with "sobrio does not support ... yet"
  unless left at their default. Checked by `SobrioConfig.from_kwargs`; never part of a config.
- `SobrioConfig` (sobrio.py, vLLM's `VllmConfig`): one engine's concerns together. It is what crosses
  to the engine-core process, so it holds nothing else. `SobrioConfig.from_kwargs` takes the flat form
  of `LLM(model, max_num_seqs=8, ...)` (vLLM's EngineArgs) and routes each keyword to its concern.
- `ServerConfig` (server.py, vLLM's frontend args) with `LimitsConfig` and `CorsConfig` nested:
  `sobrio serve`'s own process. It sits beside the engine configs, not inside them: one server runs
  one engine per model, and the cores never need it.

Every field made with `flag()` (fields.py) is a command-line flag: `sobrio/engine_args.py` builds the
flags from the fields, so each default is written once. Bad values raise `ConfigError` naming the flag,
never an assert. The configs are frozen: a value is checked once, when the config is built.
This package imports no server code; the server imports it.
"""

from sobrio.config.cache import CacheConfig
from sobrio.config.kv_transfer import KVTransferConfig
from sobrio.config.model import ATTENTION_BACKENDS, DTYPES, ModelConfig
from sobrio.config.parallel import ParallelConfig
from sobrio.config.scheduler import SchedulerConfig
from sobrio.config.server import LOG_LEVELS, CorsConfig, LimitsConfig, ServerConfig
from sobrio.config.sobrio import SobrioConfig
from sobrio.config.speculative import SpeculativeConfig
from sobrio.config.structured import StructuredOutputsConfig
from sobrio.config.unsupported import UnsupportedConfig

__all__ = ["ATTENTION_BACKENDS", "DTYPES", "LOG_LEVELS", "CacheConfig", "CorsConfig", "KVTransferConfig",
           "LimitsConfig",
           "ModelConfig", "ParallelConfig", "SchedulerConfig", "ServerConfig", "SobrioConfig", "SpeculativeConfig",
           "StructuredOutputsConfig", "UnsupportedConfig"]
