// The Python module: every operator of ops.h and the fused decode step's classes, bound here once. Only this
// file includes pybind11 (~9 s of compiling a translation unit here); the kernels' files need ATen alone.
#include <torch/csrc/utils/pybind.h>

#include "fused_decode.h"
#include "ops.h"

namespace py = pybind11;
using namespace sobrio_ops;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // paged_attention.cpp
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)", py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("window"), py::arg("key_scales") = py::none(),
        py::arg("value_scales") = py::none(), py::arg("softcap") = 0.0);
  // cpu_ops.cpp
  m.def("gemv_supported", &gemv_supported, "whether gemv_bf16 was built (AVX512-BF16)");
  m.def("gemv_bf16", &gemv_bf16, "few-row bf16 matmul x @ w.T (+ bias)", py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none());
  m.def("invariant_linear_supported", &invariant_linear_supported, "whether invariant_linear was built (AVX-512 or AVX2)");
  m.def("invariant_linear", &invariant_linear, "x @ w.T (+ bias), each row's result independent of the others",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("expert_linear", &expert_linear, "rows grouped by expert, each group @ its expert's weight.T",
        py::arg("x"), py::arg("w"), py::arg("ids"), py::arg("offsets"));
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally adding x into residual first");
  m.def("rotary_embedding", &rotary_embedding, "rotate-half RoPE in place");
  m.def("act_and_mul", &act_and_mul, "silu(gate)*up (0) or gelu_tanh(gate)*up (1)");
  m.def("write_kv", &write_kv, "new keys and values into their cache slots");
  m.def("write_kv_int8", &write_kv_int8, "new keys and values quantized into an int8 cache's slots and scales");
  m.def("argmax_rows", &argmax_rows, "each row's first index of its maximum (a NaN's, if any), as torch.max");
  // sampling.cpp
  m.def("sample_rows", &sample_rows,
        "each row's token by temperature, top-k, top-p and min-p, drawn at its uniform by inverse CDF",
        py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"),
        py::arg("uniform"));
  m.def("top_k_top_p_probs", &top_k_top_p_probs,
        "each row's probabilities at its temperature over the tokens its top-k, top-p and min-p keep",
        py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"));
  // amx_linear.cpp
  m.def("amx_supported", &amx_supported, "whether amx_linear was built and the OS grants AMX");
  m.def("amx_pack_weight", &amx_pack_weight, "a bf16 weight [N, K] in amx_linear's tile layout");
  m.def("amx_linear", &amx_linear, "x @ w.T (+ bias) on AMX tiles, w packed by amx_pack_weight",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("amx_int8_supported", &amx_int8_supported, "whether amx_int8_linear was built and the OS grants AMX");
  m.def("amx_pack_weight_int8", &amx_pack_weight_int8, "an int8 weight [N, K] in amx_int8_linear's tile layout");
  m.def("amx_int8_linear", &amx_int8_linear, "W8A8 x @ (w * scale).T (+ bias) on AMX-INT8 tiles, x rounded per token",
        py::arg("x"), py::arg("packed"), py::arg("w_scale"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("outlier_index") = py::none(), py::arg("outlier_packed") = py::none(), py::arg("float_out") = false,
        py::arg("group_k") = 0);
  // grouped_linear.cpp
  m.def("grouped_linear_supported", &grouped_linear_supported, "whether grouped_linear was built (AVX-512, or AVX2 with FMA)");
  m.def("grouped_linear", &grouped_linear,
        "few-row x @ W.T for group-wise int8 W = codes * scale + offset per group (+ bias)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets") = py::none(), py::arg("group"),
        py::arg("bias") = py::none());
  // vnni_linear.cpp
  m.def("vnni_linear_supported", &vnni_linear_supported, "whether vnni_linear was built (AVX512-VNNI)");
  m.def("vnni_linear", &vnni_linear,
        "x @ W.T for 4- or 8-bit group-wise W, x rounded to 8 or 16 bits per group, int8 dot products (+ bias)",
        py::arg("x"), py::arg("weight"), py::arg("scales"), py::arg("offsets"), py::arg("n"), py::arg("bits"),
        py::arg("group"), py::arg("code_zero"), py::arg("act_bits"), py::arg("bias") = py::none(),
        py::arg("dense_min_rows") = kDenseMinRows);
  m.attr("vnni_dense_min_rows") = kDenseMinRows;
  m.def("vnni_dequantize", &vnni_dequantize, "the [N, K] float32 (or bf16) weight of vnni_linear's codes",
        py::arg("weight"), py::arg("scales"), py::arg("offsets"), py::arg("n"), py::arg("k"), py::arg("bits"),
        py::arg("group"), py::arg("code_zero"), py::arg("bf16"));
  // blocked_gemv.cpp
  m.def("blocked_gemv_supported", &blocked_gemv_supported, "whether blocked_gemv_bf16 was built (AVX512-BF16)");
  m.def("blocked_gemv_bf16", &blocked_gemv_bf16,
        "few-row bf16 x @ W.T (+ bias), W as the [N/64, K/2, 64, 2] view of oneDNN's packed copy",
        py::arg("x"), py::arg("blocks"), py::arg("bias") = py::none());
  m.def("blocked_linear", &blocked_linear,
        "x @ W.T (+ bias) from oneDNN's packed bf16 copy: the few-row kernel up to max_rows rows, oneDNN's GEMM past",
        py::arg("x"), py::arg("packed"), py::arg("blocks"), py::arg("bias"), py::arg("max_rows"));
  m.def("pack_blocked_bf16", &pack_blocked_bf16,
        "writes a bf16 weight [N, K] into a [N/B, K/2, B, 2] blocked view (oneDNN's packed layout; B 64 or 32)",
        py::arg("weight"), py::arg("blocks"));
  // lora.cpp
  m.def("lora_apply", &lora_apply,
        "y[rows] += scale * (x[rows] @ a[slot].T) @ B[slot].T by adapter group; B packed in tiles of 64 columns a slice",
        py::arg("y"), py::arg("x"), py::arg("a"), py::arg("b"), py::arg("ranks"), py::arg("scales"), py::arg("widths"),
        py::arg("rows"), py::arg("slots"), py::arg("offsets"));
  // prompt_attention.cpp
  m.def("prompt_attention", &prompt_attention,
        "A prompt chunk's causal attention over its paged bf16 context (AVX512-BF16)", py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"), py::arg("ctx"),
        py::arg("block_size"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("prompt_attention_supported", &prompt_attention_supported);
  // fused_decode.h
  py::class_<VnniWeight>(m, "VnniWeight")
      .def(py::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>(),
           py::arg("weight"), py::arg("scales"), py::arg("offsets"), py::arg("bias"), py::arg("n"), py::arg("bits"),
           py::arg("group"), py::arg("code_zero"), py::arg("act_bits"), py::arg("dense_min_rows"));
  py::class_<BlockedWeight>(m, "BlockedWeight")
      .def(py::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, int64_t>(), py::arg("packed"),
           py::arg("blocks"), py::arg("bias"), py::arg("max_rows"));
  py::class_<AmxInt8Weight>(m, "AmxInt8Weight")
      .def(py::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, int64_t, int64_t>(), py::arg("packed"),
           py::arg("scale"), py::arg("bias"), py::arg("n"), py::arg("group"));
  py::class_<DecoderLayer>(m, "DecoderLayer")
      .def(py::init<at::Tensor, at::Tensor, Projection, Projection, Projection, Projection, double, int64_t,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>, double>(),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("scale"), py::arg("window"), py::arg("q_norm") = py::none(),
           py::arg("k_norm") = py::none(), py::arg("attn_out_norm") = py::none(), py::arg("mlp_out_norm") = py::none(),
           py::arg("cos") = py::none(), py::arg("sin") = py::none(), py::arg("softcap") = 0.0);
  py::class_<CacheLayer>(m, "CacheLayer")
      .def(py::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>>(),
           py::arg("keys"), py::arg("values"), py::arg("key_scales"), py::arg("value_scales"));
  py::class_<KVLayers>(m, "KVLayers").def(py::init<std::vector<CacheLayer>>(), py::arg("layers"));
  py::class_<FusedDecoder>(m, "FusedDecoder")
      .def(py::init<std::vector<DecoderLayer>, at::Tensor, double, int64_t, int64_t, int64_t, int64_t,
                    at::Tensor, at::Tensor, bool>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("eps"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("act"), py::arg("cos"), py::arg("sin"), py::arg("gemma") = false)
      .def("forward", &FusedDecoder::forward, py::arg("x"), py::arg("positions"), py::arg("cache"),
           py::arg("slot_mapping"), py::arg("block_tables"), py::arg("context_lens"), py::arg("block_size"));
}
