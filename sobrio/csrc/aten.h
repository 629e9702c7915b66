// What the kernels' files use of PyTorch: ATen's Tensor, its dtype dispatch, parallel_for and the four ATen
// functions they call (empty, empty_like, zeros, linear). Not <torch/extension.h>, which brings the whole C++
// frontend (nn, optim, data) and pybind11: ~40 s of compiling a translation unit here against ~6
// (docs/benchmarks.md, "The CPU fast path").
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
