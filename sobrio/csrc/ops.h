// Every operator Python calls, each defined beside its kernels (the file named above it) and bound once in
// bindings.cpp; the fused decode step (fused_decode.h) calls the same functions, so a fused path computes what
// the modules do.
#pragma once
#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "aten.h"

namespace sobrio_ops {

// Rows a thread takes at least in the per-row operators (norms, rotary, activation, the int8 kernels' rounding
// of x): enough for about 8,192 values, at most 16. The other thread spins between a step's parallel regions, so
// waking it is cheap, and a 16-row decode's activation (8,192 values a row at 1B) on one thread while it spun
// was a measurable share of the step (docs/benchmarks.md, "Per-row operators at 16 rows").
inline int64_t row_grain(int64_t values_per_row) {
  return std::clamp<int64_t>((8192 + values_per_row - 1) / std::max<int64_t>(1, values_per_row), 1, 16);
}

// paged_attention.cpp
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                  at::Tensor block_tables, at::Tensor context_lens, int64_t block_size,
                                  double scale, int64_t window, std::optional<at::Tensor> key_scales,
                                  std::optional<at::Tensor> value_scales, double softcap);

// prompt_attention.cpp
bool prompt_attention_supported();
at::Tensor prompt_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache, at::Tensor block_table,
                            int64_t ctx, int64_t block_size, double scale, int64_t window, double softcap);

// cpu_ops.cpp
bool gemv_supported();
at::Tensor gemv_bf16(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias);
bool invariant_linear_supported();
at::Tensor invariant_linear(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias);
at::Tensor expert_linear(at::Tensor x, at::Tensor w, at::Tensor ids, at::Tensor offsets);
at::Tensor rms_norm(at::Tensor x, std::optional<at::Tensor> residual, at::Tensor weight, double eps, bool gemma);
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);
at::Tensor act_and_mul(at::Tensor x, int64_t act);
void write_kv(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
              at::Tensor slot_mapping);
void write_kv_int8(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                   at::Tensor key_scales, at::Tensor value_scales, at::Tensor slot_mapping);
at::Tensor argmax_rows(at::Tensor logits);

// sampling.cpp
at::Tensor sample_rows(at::Tensor logits, at::Tensor temperature, at::Tensor top_k, at::Tensor top_p,
                       at::Tensor min_p, at::Tensor uniform);
at::Tensor top_k_top_p_probs(at::Tensor logits, at::Tensor temperature, at::Tensor top_k, at::Tensor top_p,
                             at::Tensor min_p);

// amx_linear.cpp
bool amx_supported();
at::Tensor amx_pack_weight(at::Tensor w);
at::Tensor amx_linear(at::Tensor x, at::Tensor packed, int64_t N, std::optional<at::Tensor> bias);
bool amx_int8_supported();
at::Tensor amx_pack_weight_int8(at::Tensor w);
at::Tensor amx_int8_linear(at::Tensor x, at::Tensor packed, at::Tensor w_scale, int64_t N,
                           std::optional<at::Tensor> bias, std::optional<at::Tensor> outlier_index,
                           std::optional<at::Tensor> outlier_packed, bool float_out, int64_t group_k);

// blocked_gemv.cpp
bool blocked_gemv_supported();
at::Tensor blocked_gemv_bf16(at::Tensor x, at::Tensor blocks, std::optional<at::Tensor> bias);
void pack_blocked_bf16(at::Tensor weight, at::Tensor blocks);
// x @ W.T (+ bias) from oneDNN's packed bf16 copy alone (layers/linear.py `blocked_linear`): up to `max_rows` rows
// the few-row kernel on its blocked view (`amx_linear` on AMX's blocks of 32, `blocked_gemv_bf16` on 64),
// oneDNN's GEMM past them.
at::Tensor blocked_linear(at::Tensor x, at::Tensor packed, at::Tensor blocks, std::optional<at::Tensor> bias,
                          int64_t max_rows);

// grouped_linear.cpp
bool grouped_linear_supported();
at::Tensor grouped_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, std::optional<at::Tensor> offsets,
                          int64_t group, std::optional<at::Tensor> bias);

// vnni_linear.cpp
// From this many rows (prompt chunks) `vnni_linear` multiplies x by the weight dequantized into x's dtype
// with aten's dense matmul, where bf16 runs on AMX (without AMX, layers/vnni.py `dense_min_rows` passes
// more): the int8 dot products cost ~5x at 1,000 rows. SmolLM2's layers, Intel Xeon
// with AMX, 2 threads (`benchmarks/vnni_kernels.py --rows 64,128,1000`, "vnni act16" against "dequant"):
// 64 rows 59 ms against 90, 128 rows 121 against 95, 1,000 rows 1,009 against 187.
constexpr int64_t kDenseMinRows = 128;
bool vnni_linear_supported();
at::Tensor vnni_linear(at::Tensor x, at::Tensor weight, at::Tensor scales, std::optional<at::Tensor> offsets,
                       int64_t N, int64_t bits, int64_t group, int64_t code_zero, int64_t act_bits,
                       std::optional<at::Tensor> bias, int64_t dense_min_rows);
at::Tensor vnni_dequantize(at::Tensor weight, at::Tensor scales, std::optional<at::Tensor> offsets, int64_t N,
                           int64_t K, int64_t bits, int64_t group, int64_t code_zero, bool bf16);

// lora.cpp
void lora_apply(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor ranks, at::Tensor scales,
                std::vector<int64_t> widths, at::Tensor rows, at::Tensor slots, at::Tensor offsets);

}  // namespace sobrio_ops
