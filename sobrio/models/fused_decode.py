"""A pure decode step of a Llama-family model (Llama, Mistral, Qwen2 and 3) or a Gemma 2 or 3 through its layers
in one C++ call: on VNNI codes (`--quantization gguf` and `int4`, AWQ/GPTQ checkpoints; the int8 modes where
the CPU has VNNI but no AMX-INT8), in bf16 where each Linear keeps oneDNN's packed copy alone
(`layers/linear.py` `blocked_linear`: the default on CPUs with AVX512-BF16 or AMX), or `--quantization int8`
on AMX-INT8 (`layers/quantization.py` `amx_int8_mm`).

At one sequence a decode step of SmolLM2-135M in GGUF makes about 300 operator calls, each of a few
microseconds to tens; through the modules, each also costs Python's module call, views and pybind's
argument conversion, a sizeable share of a small model's step (measured: docs/quantization.md and
docs/benchmarks.md). `FusedDecoder` (csrc/fused_decode.h) makes the same operator calls in the same order on
the same tensors, so its hidden states equal the modules' bitwise (tests/model/test_fused_decode.py); the
modules stay the reference and the path of every other step: prompt chunks, draft verification, early exits,
and models or modes it does not cover. `benchmarks/fused_decode.py` times both.

It reads the weights the modules hold when it is built (`build`, after `prepack`): a later change to them
(`model.to`, a forward hook such as tensor parallelism's collectives) needs `model.model.fused_decode = None`.
`SOBRIO_DISABLE_FUSED_DECODE=1` turns it off.
"""

import os

import torch

from sobrio.layers import vnni
from sobrio.layers.attention import AttentionMetadata, CppPagedAttention
from sobrio.layers.cpu_ops import cpu_ops
from sobrio.layers.linear import Linear, blocked_max_rows
from sobrio.layers.norm import GemmaRMSNorm, RMSNorm
from sobrio.layers.quantization import QuantizedLinear
from sobrio.layers.vnni import VnniLinear
from sobrio.models.llama import ACTIVATIONS, CausalLM, GatedMLP, LlamaAttention, LlamaDecoderLayer, SandwichDecoderLayer

# What its C++ norms, rotary and activations take: a float16 model (`--dtype float16`) keeps the modules,
# whose PyTorch operators take it (built anyway, every decode step of such a model failed).
FUSED_DTYPES = (torch.float32, torch.bfloat16)


class FusedDecode:
    """Calls `FusedDecoder.forward` for the pure decode steps of one model (`applies`)."""

    def __init__(self, decoder, dtype: torch.dtype):
        self.decoder = decoder
        self.dtype = dtype
        self._caches: tuple[object, object] | None = None  # (the KVCache, its C++ view), the last one seen

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is one it computes: every sequence one new token, a bf16 or int8 cache."""
        if meta.kv_cache is None or x.dtype != self.dtype:
            return False
        decode = meta.decode_seqs()
        return decode is not None and len(decode[0]) == meta.num_seqs and self._kv_layers(meta.kv_cache) is not None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        _, _, tables, lens = meta.decode_seqs()
        return self.decoder.forward(x, positions, self._kv_layers(meta.kv_cache), meta.slot_mapping, tables, lens,
                                    meta.block_size)

    def _kv_layers(self, kv_cache):
        """The cache's layers as the C++ decoder reads them (built once per cache), or None for a cache it
        does not read (fp8: written by PyTorch)."""
        if self._caches is None or self._caches[0] is not kv_cache:
            self._caches = (kv_cache, _kv_layers(kv_cache, self.dtype))
        return self._caches[1]


def build(model: CausalLM) -> FusedDecode | None:
    """The fused decode of a model whose every layer it covers, or None (the modules then run every step)."""
    ops = cpu_ops()
    layers = list(model.model.layers)
    final_norm = model.model.norm
    if (os.environ.get("SOBRIO_DISABLE_FUSED_DECODE") == "1" or ops is None
            or final_norm.weight.dtype not in FUSED_DTYPES or type(final_norm) not in NORMS
            or not layers or not all(map(_covered, layers))
            or any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())):
        return None
    attn = layers[0].self_attn
    norms = [n for layer in layers for n in _norms(layer)]
    if len({n.eps for n in norms} | {final_norm.eps}) != 1 or {type(n) for n in norms} != {type(final_norm)}:
        return None
    decoder = ops.FusedDecoder([_layer(ops, layer, attn.rotary) for layer in layers], final_norm.weight,
                               final_norm.eps, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                               layers[0].mlp.act_code, attn.rotary.cos, attn.rotary.sin, final_norm.offset != 0.0)
    return FusedDecode(decoder, final_norm.weight.dtype)


NORMS = (RMSNorm, GemmaRMSNorm)  # the C++ rms_norm's two: weight * normalize(x), and Gemma's (1 + weight)


def _covered(layer: torch.nn.Module) -> bool:
    """A Llama layer (two norms) or a four-norm one (Gemma 2 and 3), the four projections of one kind that
    `_weight` takes, the C++ paged attention, a plain rotary."""
    if type(layer) not in (LlamaDecoderLayer, SandwichDecoderLayer) or type(layer.self_attn) is not LlamaAttention \
            or type(layer.mlp) is not GatedMLP or type(layer.self_attn.attn) is not CppPagedAttention:
        return False
    if not layer.self_attn.rotary.plain:
        return False  # a partial or interleaved rotary (GLM-4, Phi-3's partial): the modules compute it
    kinds = {_kind(p) for p in _projections(layer)}
    return all(type(n) in NORMS for n in _norms(layer)) and layer.mlp.act_code in ACTIVATIONS.values() \
        and len(kinds) == 1 and None not in kinds


def _projections(layer) -> tuple[torch.nn.Module, ...]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _block_norms(layer) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module | None, torch.nn.Module | None]:
    """(before the attention, before the MLP, after the attention, after the MLP): the last two a four-norm
    layer's only."""
    if type(layer) is SandwichDecoderLayer:
        attn_in, attn_out, mlp_in, mlp_out = (getattr(layer, name) for name in layer.names)
        return attn_in, mlp_in, attn_out, mlp_out
    return layer.input_layernorm, layer.post_attention_layernorm, None, None


def _norms(layer) -> tuple[torch.nn.Module, ...]:
    """All the layer's norms: `_block_norms`, and Qwen3's and Gemma 3's q/k norms where it has them."""
    attn = layer.self_attn
    return tuple(n for n in (*_block_norms(layer), attn.q_norm, attn.k_norm) if n is not None)


def _kind(linear: torch.nn.Module) -> str | None:
    """Which of the C++ decoder's projections computes this module as its forward does, or None."""
    if type(linear) is VnniLinear:
        return "vnni"
    if isinstance(linear, Linear) and type(linear).forward is Linear.forward and linear.blocks is not None \
            and not linear.batch_invariant:
        return "blocked"  # a bf16 Linear (or a fused one, `PackedLinear`) on oneDNN's packed copy alone
    if type(linear) is QuantizedLinear and linear.amx_packed is not None and linear.outliers is None \
            and not linear.float_out:
        return "amx_int8"
    return None


def _layer(ops, layer, rotary):
    """The C++ DecoderLayer of one layer; `rotary`: the model's (the first layer's), which a layer with tables
    of its own (Gemma 3's local layers) does not share."""
    attn = layer.self_attn
    attn_in, mlp_in, attn_out, mlp_out = _block_norms(layer)
    optional = [None if norm is None else norm.weight for norm in (attn.q_norm, attn.k_norm, attn_out, mlp_out)]
    tables = (None, None) if attn.rotary is rotary else (attn.rotary.cos, attn.rotary.sin)
    return ops.DecoderLayer(attn_in.weight, mlp_in.weight, *[_weight(ops, p) for p in _projections(layer)],
                            attn.attn.scale, attn.attn.sliding_window or 0, *optional, *tables,
                            attn.attn.softcap or 0.0)


def _weight(ops, linear: torch.nn.Module):
    kind = _kind(linear)
    if kind == "blocked":
        return ops.BlockedWeight(linear.packed, linear.blocks, linear.bias, blocked_max_rows(linear.blocks))
    if kind == "amx_int8":
        return ops.AmxInt8Weight(linear.amx_packed, linear.scale_fp32, linear.bias, linear.scale_fp32.shape[0],
                                 linear.act_group)
    w = linear.weight_codes
    return ops.VnniWeight(w.weight, w.scales, w.offsets, linear.bias, w.out_features, w.bits, w.group_size,
                          w.code_zero, linear.act_bits, vnni.dense_min_rows(linear.act_bits))


def _kv_layers(kv_cache, dtype: torch.dtype):
    ops = cpu_ops()
    layers = []
    for i in range(len(kv_cache.layers)):
        keys, values = kv_cache.slots(i)
        scales = kv_cache.scales(i)
        if not (keys.dtype == dtype and scales is None or keys.dtype == torch.int8 and scales is not None):
            return None
        layers.append(ops.CacheLayer(keys, values, *(scales or (None, None))))
    return ops.KVLayers(layers)
