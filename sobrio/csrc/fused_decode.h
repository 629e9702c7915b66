// A pure decode step (one new token per sequence) of a Llama-family (Llama, Mistral, Qwen2 and 3) or Gemma 2
// or 3 decoder whose projections are all group-wise VNNI codes, all bf16 on oneDNN's packed copy or all int8 on
// the AMX tiles, in one call from Python: the same operators the modules call (ops.h), in the same order, on
// the same tensors, so the results equal the modules' bitwise; only the ~10 Python module calls and pybind
// argument conversions per layer are gone (models/fused_decode.py says what they cost).
#pragma once
#include <utility>
#include <variant>
#include <vector>

#include "ops.h"

namespace sobrio_ops {

// A projection on 4- or 8-bit group-wise codes, as layers/vnni.py's VnniLinear holds it.
struct VnniWeight {
  at::Tensor weight, scales;
  c10::optional<at::Tensor> offsets, bias;
  int64_t n, bits, group, code_zero, act_bits, dense_min_rows;  // the last as layers/vnni.py dense_min_rows

  at::Tensor operator()(const at::Tensor& x) const {
    return vnni_linear(x, weight, scales, offsets, n, bits, group, code_zero, act_bits, bias,
                                   dense_min_rows);
  }
};

// A bf16 projection as layers/linear.py's Linear holds it where the few-row kernel reads oneDNN's packed copy.
struct BlockedWeight {
  at::Tensor packed, blocks;
  c10::optional<at::Tensor> bias;
  int64_t max_rows;  // the few-row kernel's, as layers/linear.py blocked_linear passes it

  at::Tensor operator()(const at::Tensor& x) const { return blocked_linear(x, packed, blocks, bias, max_rows); }
};

// A projection on int8 codes with one scale a channel, on the AMX-INT8 tiles (layers/quantization.py
// QuantizedLinear with `amx_packed` and no outlier channels: W8A8, the activations rounded in the kernel per
// token, or per token and `group` inputs).
struct AmxInt8Weight {
  at::Tensor packed, scale;
  c10::optional<at::Tensor> bias;
  int64_t n, group;

  at::Tensor operator()(const at::Tensor& x) const {
    auto out = amx_int8_linear(x.contiguous(), packed, scale, n, c10::nullopt, c10::nullopt, c10::nullopt, false,
                               group);
    return bias.has_value() ? out.add(*bias) : out;  // QuantizedLinear: out + bias
  }
};

using Projection = std::variant<VnniWeight, BlockedWeight, AmxInt8Weight>;

inline at::Tensor project(const Projection& weight, const at::Tensor& x) {
  return std::visit([&x](const auto& w) { return w(x); }, weight);
}

// One decoder layer: the norms before its attention and its MLP, its four projections, its attention's scale
// and window (0: full attention); Qwen3's and Gemma 3's per-head norms of q and k; a four-norm layer's
// (Gemma 2 and 3) norms of the attention's and the MLP's outputs; its rotary tables where they are not the
// model's (Gemma 3's local layers); Gemma 2's attention logit softcap (0: none).
struct DecoderLayer {
  at::Tensor input_norm, post_norm;
  Projection qkv, o, gate_up, down;
  double scale;
  int64_t window;
  c10::optional<at::Tensor> q_norm, k_norm, attn_out_norm, mlp_out_norm, cos, sin;
  double softcap;
};

// One layer's KV cache as `KVCache.slots` / `.scales` give it: [num_slots, Hkv, D] keys and values, and
// for an int8 cache their [num_slots, Hkv] bf16 scales.
struct CacheLayer {
  at::Tensor keys, values;
  c10::optional<at::Tensor> key_scales, value_scales;
};

struct KVLayers {
  std::vector<CacheLayer> layers;
};

// Where this step's tokens are: their positions, KV slots, and each sequence's block table and length.
struct StepInputs {
  const at::Tensor& positions;
  const at::Tensor& slot_mapping;
  const at::Tensor& block_tables;
  const at::Tensor& context_lens;
  int64_t block_size;
};

class FusedDecoder {
 public:
  // gemma: every norm scales by (1 + weight) (GemmaRMSNorm), else by its weight.
  FusedDecoder(std::vector<DecoderLayer> layers, at::Tensor final_norm, double eps, int64_t heads,
               int64_t kv_heads, int64_t head_dim, int64_t act, at::Tensor cos, at::Tensor sin, bool gemma)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), eps_(eps), heads_(heads),
        kv_heads_(kv_heads), head_dim_(head_dim), act_(act), cos_(std::move(cos)), sin_(std::move(sin)),
        gemma_(gemma) {
    TORCH_CHECK(!layers_.empty() && heads_ % kv_heads_ == 0, "FusedDecoder: layers, heads a multiple of kv heads");
  }

  // x [T, hidden]: the step's embedded tokens, one per decoding sequence. Returns the final norm of the
  // residual stream, as DecoderModel.forward; adds into x in place (the first layer's residual) as it does.
  at::Tensor forward(at::Tensor x, at::Tensor positions, const KVLayers& cache, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor context_lens, int64_t block_size) const {
    TORCH_CHECK(cache.layers.size() == layers_.size(), "FusedDecoder: one cache layer per decoder layer");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) == context_lens.size(0) &&
                    x.scalar_type() == final_norm_.scalar_type(),
                "FusedDecoder: x [sequences, hidden], contiguous, in the norms' dtype");
    const StepInputs step{positions, slot_mapping, block_tables, context_lens, block_size};
    at::Tensor residual = x;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecoderLayer& w = layers_[i];
      auto h = i == 0 ? norm(x, w.input_norm) : rms_norm(x, residual, w.input_norm, eps_, gemma_);
      auto out = attention(w, cache.layers[i], h, step);
      if (w.attn_out_norm.has_value()) out = norm(out, *w.attn_out_norm);
      h = rms_norm(out, residual, w.post_norm, eps_, gemma_);
      x = project(w.down, act_and_mul(project(w.gate_up, h), act_));
      if (w.mlp_out_norm.has_value()) x = norm(x, *w.mlp_out_norm);
    }
    return rms_norm(x, residual, final_norm_, eps_, gemma_);
  }

 private:
  // LlamaAttention.forward with CppPagedAttention's decode: q and k (through their norms where the layer has
  // them) rotated in place, k and v written to their slots, each sequence's query over its cache, then o_proj.
  at::Tensor attention(const DecoderLayer& w, const CacheLayer& c, const at::Tensor& h,
                       const StepInputs& step) const {
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    auto qkv = project(w.qkv, h);
    auto q = qkv.narrow(1, 0, q_size).view({-1, heads_, head_dim_});
    auto k = qkv.narrow(1, q_size, kv_size).view({-1, kv_heads_, head_dim_});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, kv_heads_, head_dim_});
    if (w.q_norm.has_value()) {  // LlamaAttention: q_norm(q), k_norm(k), each into a new tensor
      q = norm(q, *w.q_norm);
      k = norm(k, *w.k_norm);
    }
    rotary_embedding(step.positions, q, k, w.cos.has_value() ? *w.cos : cos_, w.sin.has_value() ? *w.sin : sin_);
    if (c.key_scales.has_value())
      write_kv_int8(k, v, c.keys, c.values, *c.key_scales, *c.value_scales, step.slot_mapping);
    else
      write_kv(k, v, c.keys, c.values, step.slot_mapping);
    auto out = paged_decode_attention(q.contiguous(), c.keys, c.values, step.block_tables,
                                                  step.context_lens, step.block_size, w.scale, w.window,
                                                  c.key_scales, c.value_scales, w.softcap);
    return project(w.o, out.view({h.size(0), q_size}));
  }

  // RMSNorm.forward without a residual: a new tensor.
  at::Tensor norm(const at::Tensor& x, const at::Tensor& weight) const {
    return rms_norm(x.contiguous(), c10::nullopt, weight, eps_, gemma_);
  }

  std::vector<DecoderLayer> layers_;
  at::Tensor final_norm_;
  double eps_;
  int64_t heads_, kv_heads_, head_dim_, act_;
  at::Tensor cos_, sin_;
  bool gemma_;
};

}  // namespace sobrio_ops
