"""Gemma 3 text: QK-norm, four norms per layer, sliding-window layers with their own RoPE base,
scaled embeddings, GELU-tanh."""

import torch

from sobrio.layers.attention import BatchedDecodeAttention, ReferenceAttention
from sobrio.layers.norm import GemmaRMSNorm
from sobrio.layers.rotary import RotaryEmbedding
from sobrio.models.llama import CausalLM, DecoderModel, GatedMLP, LlamaAttention, head_dim_of


class Gemma3Attention(LlamaAttention):
    def __init__(self, config, rotary, sliding_window, attn_cls, layer_idx: int):
        super().__init__(config, rotary, sliding_window, config.query_pre_attn_scalar ** -0.5, attn_cls, layer_idx)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm(self, q, k):
        return self.q_norm(q), self.k_norm(k)


class Gemma3DecoderLayer(torch.nn.Module):
    def __init__(self, config, layer_type: str, rotary: RotaryEmbedding, attn_cls: type[ReferenceAttention],
                 layer_idx: int):
        super().__init__()
        window = config.sliding_window if layer_type == "sliding_attention" else None
        self.self_attn = Gemma3Attention(config, rotary, window, attn_cls, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)
        norm = lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, positions, x, residual, meta):
        """Returns (this layer's output, the residual stream before it): the next norm adds them."""
        x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, meta))
        x, residual = self.pre_feedforward_layernorm.add_and_norm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config, max_positions: int, attn_cls: type[ReferenceAttention] = BatchedDecodeAttention,
                 batch_invariant: bool = False):
        head_dim = head_dim_of(config)
        rotary = {t: RotaryEmbedding(config, head_dim, max_positions, t) for t in set(config.layer_types)}
        layers = [Gemma3DecoderLayer(config, t, rotary[t], attn_cls, i) for i, t in enumerate(config.layer_types)]
        model = DecoderModel(config, layers, GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))
        model.embed_scale = config.hidden_size ** 0.5
        super().__init__(config, model, batch_invariant)
