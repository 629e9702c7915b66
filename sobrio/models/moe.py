"""Mixture-of-experts families on the Llama decoder: Mixtral (Llama attention), Qwen3-MoE (q/k RMSNorm per
head) and Qwen2-MoE (q/k/v bias, a shared expert behind a sigmoid gate), their sparse FFN layers/moe.py's.

Qwen's `decoder_sparse_step` and `mlp_only_layers` choose which layers are sparse; the others are dense
`GatedMLP`s of `intermediate_size`. A field this file does not compute is refused at load (`check_config`).
"""

import torch

from sobrio.errors import ConfigError
from sobrio.layers.activation import ACTIVATIONS
from sobrio.layers.attention import BatchedDecodeAttention, ReferenceAttention
from sobrio.layers.moe import SparseMoE
from sobrio.layers.norm import RMSNorm
from sobrio.layers.rotary import RotaryEmbedding
from sobrio.models.llama import CausalLM, DecoderModel, GatedMLP, LlamaAttention, LlamaDecoderLayer, head_dim_of
from sobrio.models.weights import PackedLinear

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


def num_experts(config) -> int:
    """The routed experts of a layer: Mixtral's `num_local_experts`, Qwen's `num_experts`."""
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0) or 0


def check_config(config) -> None:
    """Refuse, by name, what these modules do not compute: an activation without a kernel, more experts per
    token than there are. (Training-only fields, router jitter and auxiliary losses, change nothing here.)"""
    if config.hidden_act not in ACTIVATIONS:
        raise ConfigError(f"{config.model_type}: hidden_act {config.hidden_act!r} is not supported (supported: "
                          f"{', '.join(ACTIVATIONS)})", "--model")
    if not 0 < config.num_experts_per_tok <= num_experts(config):
        raise ConfigError(f"{config.model_type}: num_experts_per_tok {config.num_experts_per_tok} does not fit "
                          f"{num_experts(config)} experts", "--model")


def is_sparse(config, layer_idx: int) -> bool:
    """Whether layer `layer_idx` routes to experts (Qwen's `decoder_sparse_step`, `mlp_only_layers`)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and (layer_idx + 1) % step == 0


def sliding_window(config, layer_idx: int) -> int | None:
    """The layer's attention window, or None: Qwen2-MoE's per `layer_types`, the others' `sliding_window`
    (Qwen3-MoE's config leaves it None unless `use_sliding_window`)."""
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return window


class QkNormAttention(LlamaAttention):
    """Qwen3's attention: an RMSNorm over each head's q and k before RoPE."""

    def __init__(self, config, rotary, sliding_window, attn_cls, layer_idx: int):
        super().__init__(config, rotary, sliding_window, attn_cls=attn_cls, layer_idx=layer_idx)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm(self, q, k):
        return self.q_norm(q), self.k_norm(k)


def _attention(config, rotary: RotaryEmbedding, attn_cls: type[ReferenceAttention], layer_idx: int) -> LlamaAttention:
    window = sliding_window(config, layer_idx)
    if config.model_type == "qwen3_moe":
        return QkNormAttention(config, rotary, window, attn_cls, layer_idx)
    attn = LlamaAttention(config, rotary, window, attn_cls=attn_cls, layer_idx=layer_idx)
    if getattr(config, "qkv_bias", False):  # Qwen2-MoE: biased q/k/v, unbiased o_proj
        attn.qkv_proj = PackedLinear(config.hidden_size, attn.split, bias=True)
    return attn


def _mlp(config, layer_idx: int) -> torch.nn.Module:
    if not is_sparse(config, layer_idx):
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    shared = None
    if getattr(config, "shared_expert_intermediate_size", 0):
        shared = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act)
    intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    normalize = config.model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))
    return SparseMoE(config.hidden_size, intermediate, num_experts(config), config.num_experts_per_tok, normalize,
                     config.hidden_act, shared)


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer (its forward) with a sparse FFN, or a dense one where the config says."""

    def __init__(self, config, rotary: RotaryEmbedding, attn_cls: type[ReferenceAttention], layer_idx: int):
        torch.nn.Module.__init__(self)
        self.self_attn = _attention(config, rotary, attn_cls, layer_idx)
        self.mlp = _mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MoeForCausalLM(CausalLM):
    def __init__(self, config, max_positions: int, attn_cls: type[ReferenceAttention] = BatchedDecodeAttention,
                 batch_invariant: bool = False):
        check_config(config)
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        layers = [MoeDecoderLayer(config, rotary, attn_cls, i) for i in range(config.num_hidden_layers)]
        model = DecoderModel(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps))
        super().__init__(config, model, batch_invariant)
