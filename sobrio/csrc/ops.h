// The operators other translation units call directly (fused_decode.cpp), each defined beside its kernels
// and forwarding to them; the same functions Python calls, so a fused path computes what the modules do.
#pragma once
#include <torch/extension.h>

namespace sobrio_ops {

torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps,
                       bool gemma);
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                      torch::Tensor sin);
torch::Tensor act_and_mul(torch::Tensor x, int64_t act);
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
              torch::Tensor slot_mapping);
void write_kv_int8(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
                   torch::Tensor key_scales, torch::Tensor value_scales, torch::Tensor slot_mapping);
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     double scale, int64_t window, std::optional<torch::Tensor> key_scales,
                                     std::optional<torch::Tensor> value_scales);
// From dense_min_rows rows, the dense path (the modules pass layers/vnni.py dense_min_rows: the same switch).
torch::Tensor vnni_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scales,
                          c10::optional<torch::Tensor> offsets, int64_t N, int64_t bits, int64_t group,
                          int64_t code_zero, int64_t act_bits, c10::optional<torch::Tensor> bias,
                          int64_t dense_min_rows);

}  // namespace sobrio_ops
