"""Gemma 2 and Gemma 3 text: four norms a layer, alternating sliding-window and global layers, scaled
embeddings, GELU-tanh, `query_pre_attn_scalar`, an attention logit softcap where the config sets one. Gemma 3
adds per-head q/k norms and a RoPE base per layer type; Gemma 2 caps the attention logits and the final logits
(`attn_logit_softcapping`; `final_logit_softcapping` in `CausalLM.compute_logits`)."""

from sobrio.layers.attention import BatchedDecodeAttention, ReferenceAttention
from sobrio.layers.norm import GemmaRMSNorm
from sobrio.layers.rotary import RotaryEmbedding
from sobrio.models.llama import CausalLM, DecoderModel, head_dim_of, sandwich_layers

GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")


class GemmaForCausalLM(CausalLM):
    """Gemma 2 (`gemma2`) and Gemma 3 text (`gemma3_text`)."""

    def __init__(self, config, max_positions: int, attn_cls: type[ReferenceAttention] = BatchedDecodeAttention,
                 batch_invariant: bool = False):
        head_dim = head_dim_of(config)
        gemma3 = config.model_type.startswith("gemma3")
        types = sorted(set(config.layer_types))
        if gemma3:  # a RoPE base per layer type
            rotary = {t: RotaryEmbedding(config, head_dim, max_positions, t) for t in types}
        else:
            rotary = dict.fromkeys(types, RotaryEmbedding(config, head_dim, max_positions))
        layers = sandwich_layers(config, lambda i: rotary[config.layer_types[i]], GemmaRMSNorm, GEMMA_NORMS,
                                 scale=config.query_pre_attn_scalar ** -0.5, attn_cls=attn_cls,
                                 qk_norm_cls=GemmaRMSNorm if gemma3 else None,
                                 softcap=getattr(config, "attn_logit_softcapping", None))
        model = DecoderModel(config, layers, GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))
        model.embed_scale = config.hidden_size ** 0.5
        super().__init__(config, model, batch_invariant)
