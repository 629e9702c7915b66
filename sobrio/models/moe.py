"""Mixture-of-experts families on the Llama decoder: Mixtral (Llama attention), Qwen3-MoE (q/k RMSNorm per
head, Qwen3's attention switch) and Qwen2-MoE (q/k/v bias, a shared expert behind a sigmoid gate), their
sparse FFN layers/moe.py's.

Qwen's `decoder_sparse_step` and `mlp_only_layers` choose which layers are sparse; the others are dense
`GatedMLP`s of `intermediate_size`. A field this file does not compute is refused at load (`check_config`).
"""

import torch

from sobrio.errors import ConfigError
from sobrio.layers.attention import BatchedDecodeAttention, ReferenceAttention
from sobrio.layers.moe import SparseMoE
from sobrio.models.llama import GatedMLP, LlamaForCausalLM, dense_mlp


def num_experts(config) -> int:
    """The routed experts of a layer: Mixtral's `num_local_experts`, Qwen's `num_experts`."""
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0) or 0


def check_config(config) -> None:
    """Refuse more experts per token than there are, by name (the registry's `check_config` refuses the fields
    every family shares, the activation among them; training-only fields, router jitter and auxiliary
    losses, change nothing here)."""
    if not 0 < config.num_experts_per_tok <= num_experts(config):
        raise ConfigError(f"{config.model_type}: num_experts_per_tok {config.num_experts_per_tok} does not fit "
                          f"{num_experts(config)} experts", "--model")


def is_sparse(config, layer_idx: int) -> bool:
    """Whether layer `layer_idx` routes to experts (Qwen's `decoder_sparse_step`, `mlp_only_layers`)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and (layer_idx + 1) % step == 0


def moe_mlp(config, layer_idx: int) -> torch.nn.Module:
    """Layer `layer_idx`'s feed-forward block: routed experts (with Qwen2-MoE's shared one), or dense."""
    if not is_sparse(config, layer_idx):
        return dense_mlp(config, layer_idx)
    shared = None
    if getattr(config, "shared_expert_intermediate_size", 0):
        shared = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act)
    intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    normalize = config.model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))
    return SparseMoE(config.hidden_size, intermediate, num_experts(config), config.num_experts_per_tok, normalize,
                     config.hidden_act, shared)


class MoeForCausalLM(LlamaForCausalLM):
    """Llama's decoder (Qwen3-MoE's q/k norm and Qwen2-MoE's q/k/v bias are its attention switches) with a
    sparse FFN where the config says (`moe_mlp`)."""

    mlp_factory = staticmethod(moe_mlp)

    def __init__(self, config, max_positions: int, attn_cls: type[ReferenceAttention] = BatchedDecodeAttention,
                 batch_invariant: bool = False):
        check_config(config)
        super().__init__(config, max_positions, attn_cls, batch_invariant)
