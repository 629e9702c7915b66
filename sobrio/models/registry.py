"""Map a Hugging Face architecture (or model_type) to sobrio's class."""

import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from sobrio.config.model import QUANTIZATION_METHODS
from sobrio.errors import InvalidRequestError
from sobrio.layers.moe import FusedExperts
from sobrio.layers.rotary import check_rope
from sobrio.memory import release_freed_memory
from sobrio.models.gemma3 import GemmaForCausalLM
from sobrio.models.glm4 import Glm4ForCausalLM
from sobrio.models.llama import ACTIVATIONS, CausalLM, LlamaForCausalLM, layer_window
from sobrio.models.moe import MoeForCausalLM
from sobrio.models.weights import EXPERT_RECORD, Prequantized, PrequantizedWeight, WeightItem

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    """One supported family: what docs/models.md's table lists (tests/unit/test_models_doc.py reads one
    against the other)."""

    name: str
    model_types: tuple[str, ...]  # config.json's model_type
    architectures: tuple[str, ...]  # config.json's architectures
    cls: type[CausalLM]
    gguf: tuple[str, ...]  # llama.cpp's general.architecture names whose GGUF files sobrio reads
    sliding_window: str  # which layers it windows (docs)
    tensor_parallel: bool = True  # q/k/v and gate/up stored apart, as the rank sharding cuts them
    experts: bool = False  # a mixture-of-experts family (its `cls` sets an `mlp_factory` of experts)


FAMILIES = (
    Family("Llama (Llama 2, 3, 3.x; SmolLM2)", ("llama",), ("LlamaForCausalLM",), LlamaForCausalLM, ("llama",),
           "no"),
    Family("Mistral", ("mistral",), ("MistralForCausalLM",), LlamaForCausalLM, ("llama",),
           "every layer (`sliding_window`)"),
    Family("Qwen2, Qwen2.5", ("qwen2",), ("Qwen2ForCausalLM",), LlamaForCausalLM, ("qwen2",),
           "layers from `max_window_layers` on, with `use_sliding_window`"),
    Family("Qwen3", ("qwen3",), ("Qwen3ForCausalLM",), LlamaForCausalLM, ("qwen3",),
           "`layer_types` (`use_sliding_window`)"),
    Family("Phi-3, Phi-3.5, Phi-4-mini", ("phi3",), ("Phi3ForCausalLM",), LlamaForCausalLM, ("phi3",),
           "every layer (`sliding_window`)", tensor_parallel=False),
    Family("Gemma 2", ("gemma2",), ("Gemma2ForCausalLM",), GemmaForCausalLM, ("gemma2",),
           "alternate layers (`layer_types`)"),
    Family("Gemma 3 (text)", ("gemma3_text",), ("Gemma3ForCausalLM",), GemmaForCausalLM, ("gemma3",),
           "5 of 6 layers (`layer_types`)"),
    Family("GLM-4", ("glm4",), ("Glm4ForCausalLM",), Glm4ForCausalLM, ("glm4",), "no", tensor_parallel=False),
    Family("Mixtral (mixture of experts)", ("mixtral",), ("MixtralForCausalLM",), MoeForCausalLM, ("llama",),
           "every layer (`sliding_window`)", tensor_parallel=False, experts=True),
    Family("Qwen3-MoE", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), MoeForCausalLM, ("qwen3moe",),
           "every layer, with `use_sliding_window`", tensor_parallel=False, experts=True),
    Family("Qwen2-MoE, Qwen1.5-MoE (shared expert)", ("qwen2_moe",), ("Qwen2MoeForCausalLM",), MoeForCausalLM, (),
           "layers from `max_window_layers` on, with `use_sliding_window`", tensor_parallel=False, experts=True),
)
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
LAYER_TYPES = ("sliding_attention", "full_attention")
SOFTCAP_FAMILIES = ("gemma2", "gemma3_text")


def family_of(config) -> Family:
    family = _BY_MODEL_TYPE.get(config.model_type)
    if family is None:
        raise InvalidRequestError(
            f"unsupported architecture {config.model_type!r}; supported: {', '.join(_BY_MODEL_TYPE)}"
        )
    return family


def model_class(config) -> type[CausalLM]:
    family = family_of(config)
    unknown = [a for a in getattr(config, "architectures", None) or () if a not in family.architectures]
    if unknown:
        raise InvalidRequestError(f"unsupported architecture {unknown[0]!r} (config field architectures); "
                                  f"supported for {config.model_type}: {', '.join(family.architectures)}")
    check_config(config, family)
    return family.cls


def kv_window(config) -> int | None:
    """The widest sliding window when every layer has one (Mistral, Phi-3 with `sliding_window`): KV blocks
    behind it are read by no layer and may be freed during decode. None when any layer attends globally."""
    windows = [layer_window(config, i) for i in range(config.num_hidden_layers)]
    return None if not windows or None in windows else max(windows)


def check_config(config, family: Family) -> None:
    """Refuse, naming the field, a config value that transformers computes and sobrio does not: such a
    checkpoint would load and answer wrong."""
    check_rope(config)
    refusals = {
        "mlp_bias": bool(getattr(config, "mlp_bias", False)),
        "use_bidirectional_attention": bool(getattr(config, "use_bidirectional_attention", False)),
        "layer_types": any(t not in LAYER_TYPES for t in getattr(config, "layer_types", None) or ()),
        "attn_logit_softcapping": config.model_type not in SOFTCAP_FAMILIES
        and bool(getattr(config, "attn_logit_softcapping", None)),
        "num_experts": not family.experts
        and bool(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)),
    }
    act_field = "hidden_activation" if getattr(config, "hidden_activation", None) else "hidden_act"
    refusals[act_field] = getattr(config, act_field, "silu") not in ACTIVATIONS
    for name, refused in refusals.items():
        if refused:
            raise InvalidRequestError(f"config field {name}={getattr(config, name, None)!r} is not supported "
                                      f"for {config.model_type} (sobrio would compute it wrong)", name)


def build_model(config, max_positions: int, weights, dtype: torch.dtype, attention_backend: str,
                batch_invariant: bool = False, quantization: str | None = None,
                calibration_ids: list[int] | None = None, quantization_cache=None,
                reread: Callable[[], Iterable[WeightItem]] | None = None) -> CausalLM:
    """The model, its weights loaded (and quantized, where `quantization` is a method computed at load). With
    `quantization_cache` (loader/quantization_cache.py `QuantizationCache`) an entry it holds replaces the
    checkpoint's weights and the quantizing; without one, the quantized model is written to it.
    `reread`: the checkpoint's float weights again, unread (a float checkpoint's `iter_weights(in_place=True)`).
    Given, a model quantized at load streams its decoder layers and untied LM head: `weights` fills the rest,
    and each of those is read from a `reread()` of its own just before it is quantized, so the load never holds
    more than one layer's float weights beside the quantized ones (an 8B model in int8 peaked at its bf16
    size)."""
    from sobrio.layers.attention import BatchInvariantAttention, resolve_backend
    from sobrio.layers.linear import one_copy_layout
    from sobrio.models import fused_decode
    from sobrio.models.pack_on_load import PackOnLoad
    from sobrio.models.weights import load_weights

    if batch_invariant:
        check_batch_invariant(attention_backend)
    attn_cls = BatchInvariantAttention if batch_invariant else resolve_backend(attention_backend)
    cached = quantization_cache.read() if quantization_cache is not None else None
    pack_on_load = None
    with torch.device("cpu"), _parameters_not_initialized():
        model = model_class(config)(config, max_positions, attn_cls, batch_invariant=batch_invariant)
    if cached is not None:
        cached = _fitting(cached, model)
    # The parameters in the dtype before the checkpoint is copied in, so it goes straight into it: loaded first in
    # float32 and cast after, a bf16 model passed through three times its size.
    model = _in_dtype(model, dtype, unwritten=cached is None).eval().requires_grad_(False)
    streamed = cached is None and quantization in QUANTIZATION_METHODS and reread is not None
    if cached is not None:
        cached.install(model)
    else:
        packing = quantization not in QUANTIZATION_METHODS and not batch_invariant and one_copy_layout()
        pack_on_load = PackOnLoad(model) if packing else None
        installer = PrequantizedInstaller(model, dtype)
        installer.install_all(load_weights(model, weights, pack_on_load, _read_first if streamed else None,
                                           installer))  # records incomplete there are refused by name there
    if cached is None and quantization in QUANTIZATION_METHODS:  # a checkpoint's own (awq, gptq, gguf) is in place
        names_before = {name for name, _ in model.named_modules()}
        parameters_before = {name for name, _ in model.named_parameters()}
        fill = (lambda prefix: _fill(model, reread(), prefix)) if streamed else None
        model.quantize(quantization, calibration_ids, fill)
        if quantization_cache is not None:
            quantization_cache.write(model, names_before, parameters_before)
    model.prepack()
    if pack_on_load is not None:
        pack_on_load.settle(model)
    model.model.fused_decode = fused_decode.build(model)
    release_freed_memory()  # the load's transient tensors, kept by the heap otherwise
    return model


STREAMED = ("model.layers.", "lm_head.")  # what a streamed load reads later, a part at a time (`CausalLM.quantize`)


def _read_first(name: str) -> bool:
    return not name.startswith(STREAMED)


def _fill(model: CausalLM, weights: Iterable[WeightItem], prefix: str) -> None:
    """The float weights of the parameters named `prefix`... from the checkpoint (its other tensors skipped
    unread): a decoder layer's (`model.layers.3.`), or the untied LM head's (`lm_head.`)."""
    from sobrio.models.weights import load_weights

    records = load_weights(model, weights, only=lambda name: name.startswith(prefix))
    assert not records, f"a streamed load is for float checkpoints: {sorted(records)[:3]} held quantized"


def _in_dtype(model: CausalLM, dtype: torch.dtype, unwritten: bool) -> CausalLM:
    """The model in `dtype`. `unwritten`: its parameters are about to be overwritten by the checkpoint
    (`load_weights` asserts that each is), so each float one gets fresh memory in `dtype` instead of a cast
    of its unwritten values: casting read and wrote a bf16 model's memory once more (a second of a 1B
    model's start on a 2-core Zen 4). The Parameter objects stay, so tied ones stay tied."""
    if unwritten:
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = torch.empty(param.shape, dtype=dtype)
    return model.to(dtype)  # buffers (rotary tables), and the parameters of an entry's model


def _fitting(cached, model: CausalLM):
    """The cache entry with the float modules it replaces dropped from `model` (before the cast), or None
    (one log line) where it does not fit the model."""
    try:
        cached.check(model)
        cached.load()
    except (OSError, ValueError) as exc:
        logger.warning("quantization cache: entry unusable (%s): quantizing again and replacing it", exc)
        return None
    cached.strip(model)
    return cached


@contextlib.contextmanager
def _parameters_not_initialized():
    """Build the modules without drawing their random initial weights: the checkpoint overwrites every
    parameter (`load_weights` asserts it), and drawing Gemma 3's 168M-entry embedding alone took 2.2 s of
    each start on a 2-core AMD. transformers' `no_init_weights` does the same."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
             "trunc_normal_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


class PrequantizedInstaller:
    """Replaces each module a checkpoint holds quantized by the module its records build, as `load_weights`
    hands them over (`install`: the records of a module once all are read, so a GGUF's decoded blocks do not
    all wait for the end): a Linear keeps its float bias (cast already); the embedding's record also serves as
    the tied LM head; a layer's routed experts (`FusedExperts`) get a module per expert matrix, as
    `--quantization int8/int4` gives them, once all are in (`install_all`)."""

    def __init__(self, model: CausalLM, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        self.experts: dict[str, dict[str, torch.nn.Module]] = {}

    def __call__(self, name: str, records: list[PrequantizedWeight]) -> None:
        model = self.model
        record = records[0] if len(records) == 1 else records[0].concat(records)
        if EXPERT_RECORD in name:
            module, _, key = name.partition(EXPERT_RECORD)
            self.experts.setdefault(module, {})[key] = record.linear(None)
        elif name == "model.embed_tokens":
            model.model.embed_tokens = _embedding(record, self.dtype)
            if model.config.tie_word_embeddings:  # not `lm_head is None`: an untied head's record may come first
                model.quantized_lm_head = record.linear(None)
        elif name == "lm_head":
            model.quantized_lm_head, model.lm_head = record.linear(None), None
        else:
            parent_name, _, child = name.rpartition(".")
            bias = model.get_submodule(name).bias
            setattr(model.get_submodule(parent_name), child, record.linear(None if bias is None else bias.detach()))

    def install_all(self, prequantized: Prequantized) -> None:
        """The records not handed over yet, then every layer's experts."""
        for name in list(prequantized):
            self(name, prequantized.pop(name))
        for name, modules in self.experts.items():
            _install_experts(self.model.get_submodule(name), modules, name)
        self.experts = {}


def _install_experts(experts: FusedExperts, modules: dict[str, torch.nn.Module], name: str) -> None:
    """Every expert's gate/up and down modules in place of the float stacks (dropped): all of them, or a
    NotImplementedError naming what is missing (a file with some experts quantized and others not)."""
    keys = [f"{e}.{stacked}" for e in range(experts.num_experts) for stacked in ("gate_up_proj", "down_proj")]
    if missing := [key for key in keys if key not in modules]:
        raise NotImplementedError(f"{name}: experts {missing[:3]} are float beside quantized ones; load the file "
                                  f"without --quantization gguf")
    experts.quantized_gate_up = torch.nn.ModuleList(modules[f"{e}.gate_up_proj"] for e in range(experts.num_experts))
    experts.quantized_down = torch.nn.ModuleList(modules[f"{e}.down_proj"] for e in range(experts.num_experts))
    experts.gate_up_proj = experts.down_proj = None


def _embedding(record: PrequantizedWeight, dtype: torch.dtype) -> torch.nn.Module:
    if not hasattr(record, "embedding"):
        raise NotImplementedError(f"{type(record).__name__}: a pre-quantized embedding of this kind is not "
                                  f"supported")
    return record.embedding(dtype)


def check_batch_invariant(attention_backend: str) -> None:
    """Batch invariance rests on the C++ operators: the matmul and attention kernels, and RMSNorm, RoPE and
    the gated activation, which compute each row alone (their PyTorch fallbacks may not)."""
    from sobrio.layers.cpu_ops import cpu_ops, invariant_linear_available

    if cpu_ops() is None or not invariant_linear_available():
        raise InvalidRequestError("batch_invariant needs sobrio's C++ operators built on a CPU with AVX-512 "
                                  "(run `python -m sobrio.csrc`; SOBRIO_DISABLE_CPP must be unset)")
    if attention_backend not in ("auto", "cpp"):
        raise InvalidRequestError(f"batch_invariant has its own attention; attention_backend "
                                  f"{attention_backend!r} cannot be used with it")
