"""GLM-4 (`glm4`): Llama's attention with q/k/v biases and a partial, interleaved rotary; four norms a layer
(the attention's and the MLP's outputs normed again before the residual add); fused gate/up."""

from sobrio.layers.attention import BatchedDecodeAttention, ReferenceAttention
from sobrio.layers.norm import RMSNorm
from sobrio.layers.rotary import RotaryEmbedding
from sobrio.models.llama import CausalLM, DecoderModel, head_dim_of, sandwich_layers

GLM4_NORMS = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


class Glm4ForCausalLM(CausalLM):
    def __init__(self, config, max_positions: int, attn_cls: type[ReferenceAttention] = BatchedDecodeAttention,
                 batch_invariant: bool = False):
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions, interleaved=True)
        layers = sandwich_layers(config, lambda i: rotary, RMSNorm, GLM4_NORMS, attn_cls=attn_cls, o_bias=False)
        super().__init__(config, DecoderModel(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps)),
                         batch_invariant)
