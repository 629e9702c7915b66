// A pure decode step (one new token per sequence) of a Llama-family decoder whose projections are all
// group-wise VNNI codes, in one call from Python: the same operators the modules call (ops.h), in the
// same order, on the same tensors, so the results equal the modules' bitwise; only the ~10 Python module
// calls and pybind argument conversions per layer are gone (models/fused_decode.py says what they cost).
#include <torch/extension.h>

#include <utility>
#include <vector>

#include "ops.h"

namespace {

// A projection on 4- or 8-bit group-wise codes, as layers/vnni.py's VnniLinear holds it.
struct VnniWeight {
  torch::Tensor weight, scales;
  c10::optional<torch::Tensor> offsets, bias;
  int64_t n, bits, group, code_zero, act_bits, dense_min_rows;  // the last as layers/vnni.py dense_min_rows

  torch::Tensor operator()(const torch::Tensor& x) const {
    return sobrio_ops::vnni_linear(x, weight, scales, offsets, n, bits, group, code_zero, act_bits, bias,
                                   dense_min_rows);
  }
};

// One decoder layer: its two norms' weights, its four projections, its attention's scale and window
// (0: full attention).
struct DecoderLayer {
  torch::Tensor input_norm, post_norm;
  VnniWeight qkv, o, gate_up, down;
  double scale;
  int64_t window;
};

// One layer's KV cache as `KVCache.slots` / `.scales` give it: [num_slots, Hkv, D] keys and values, and
// for an int8 cache their [num_slots, Hkv] bf16 scales.
struct CacheLayer {
  torch::Tensor keys, values;
  c10::optional<torch::Tensor> key_scales, value_scales;
};

struct KVLayers {
  std::vector<CacheLayer> layers;
};

// Where this step's tokens are: their positions, KV slots, and each sequence's block table and length.
struct StepInputs {
  const torch::Tensor& positions;
  const torch::Tensor& slot_mapping;
  const torch::Tensor& block_tables;
  const torch::Tensor& context_lens;
  int64_t block_size;
};

class LlamaDecoder {
 public:
  LlamaDecoder(std::vector<DecoderLayer> layers, torch::Tensor final_norm, double eps, int64_t heads,
               int64_t kv_heads, int64_t head_dim, int64_t act, torch::Tensor cos, torch::Tensor sin)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), eps_(eps), heads_(heads),
        kv_heads_(kv_heads), head_dim_(head_dim), act_(act), cos_(std::move(cos)), sin_(std::move(sin)) {
    TORCH_CHECK(!layers_.empty() && heads_ % kv_heads_ == 0, "LlamaDecoder: layers, heads a multiple of kv heads");
  }

  // x [T, hidden]: the step's embedded tokens, one per decoding sequence. Returns the final norm of the
  // residual stream, as DecoderModel.forward; adds into x in place (the first layer's residual) as it does.
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, const KVLayers& cache, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size) const {
    TORCH_CHECK(cache.layers.size() == layers_.size(), "LlamaDecoder: one cache layer per decoder layer");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) == context_lens.size(0) &&
                    x.scalar_type() == final_norm_.scalar_type(),
                "LlamaDecoder: x [sequences, hidden], contiguous, in the norms' dtype");
    const StepInputs step{positions, slot_mapping, block_tables, context_lens, block_size};
    torch::Tensor residual = x;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecoderLayer& w = layers_[i];
      auto h = i == 0 ? sobrio_ops::rms_norm(x, c10::nullopt, w.input_norm, eps_, false)
                      : sobrio_ops::rms_norm(x, residual, w.input_norm, eps_, false);
      h = sobrio_ops::rms_norm(attention(w, cache.layers[i], h, step), residual, w.post_norm, eps_, false);
      x = w.down(sobrio_ops::act_and_mul(w.gate_up(h), act_));
    }
    return sobrio_ops::rms_norm(x, residual, final_norm_, eps_, false);
  }

 private:
  // LlamaAttention.forward with CppPagedAttention's decode: q, k rotated in place in the qkv output, k
  // and v written to their slots, each sequence's query over its cache, then o_proj.
  torch::Tensor attention(const DecoderLayer& w, const CacheLayer& c, const torch::Tensor& h,
                          const StepInputs& step) const {
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    auto qkv = w.qkv(h);
    auto q = qkv.narrow(1, 0, q_size).view({-1, heads_, head_dim_});
    auto k = qkv.narrow(1, q_size, kv_size).view({-1, kv_heads_, head_dim_});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, kv_heads_, head_dim_});
    sobrio_ops::rotary_embedding(step.positions, q, k, cos_, sin_);
    if (c.key_scales.has_value())
      sobrio_ops::write_kv_int8(k, v, c.keys, c.values, *c.key_scales, *c.value_scales, step.slot_mapping);
    else
      sobrio_ops::write_kv(k, v, c.keys, c.values, step.slot_mapping);
    auto out = sobrio_ops::paged_decode_attention(q.contiguous(), c.keys, c.values, step.block_tables,
                                                  step.context_lens, step.block_size, w.scale, w.window,
                                                  c.key_scales, c.value_scales);
    return w.o(out.view({h.size(0), q_size}));
  }

  std::vector<DecoderLayer> layers_;
  torch::Tensor final_norm_;
  double eps_;
  int64_t heads_, kv_heads_, head_dim_, act_;
  torch::Tensor cos_, sin_;
};

}  // namespace

void register_fused_decode(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<VnniWeight>(m, "VnniWeight")
      .def(py::init<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>(),
           py::arg("weight"), py::arg("scales"), py::arg("offsets"), py::arg("bias"), py::arg("n"), py::arg("bits"),
           py::arg("group"), py::arg("code_zero"), py::arg("act_bits"), py::arg("dense_min_rows"));
  py::class_<DecoderLayer>(m, "DecoderLayer")
      .def(py::init<torch::Tensor, torch::Tensor, VnniWeight, VnniWeight, VnniWeight, VnniWeight, double, int64_t>(),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("scale"), py::arg("window"));
  py::class_<CacheLayer>(m, "CacheLayer")
      .def(py::init<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>(),
           py::arg("keys"), py::arg("values"), py::arg("key_scales"), py::arg("value_scales"));
  py::class_<KVLayers>(m, "KVLayers").def(py::init<std::vector<CacheLayer>>(), py::arg("layers"));
  py::class_<LlamaDecoder>(m, "LlamaDecoder")
      .def(py::init<std::vector<DecoderLayer>, torch::Tensor, double, int64_t, int64_t, int64_t, int64_t,
                    torch::Tensor, torch::Tensor>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("eps"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("act"), py::arg("cos"), py::arg("sin"))
      .def("forward", &LlamaDecoder::forward, py::arg("x"), py::arg("positions"), py::arg("cache"),
           py::arg("slot_mapping"), py::arg("block_tables"), py::arg("context_lens"), py::arg("block_size"));
}
