// Moving data between ExecuTorch tensors and mlx arrays.
#pragma once

#include <cstddef>

#include <executorch/runtime/core/error.h>
#include <executorch/runtime/core/portable_type/tensor.h>
#include <mlx/array.h>

#include "dtypes.h"

namespace etmlx {

using ETTensor = executorch::runtime::etensor::Tensor;

// Graph input `index` as an mlx array. The tensor must be contiguous in the default dim order and
// have dtype `expected`. Without `copy` the array wraps the caller's memory (a no-op deleter: the
// caller keeps ownership), valid only while the call lasts; with `copy` it owns a copy, for a
// graph whose evaluation may outlive the call (state evaluated after execute returns).
executorch::runtime::Error wrap_input(const ETTensor& t, fb::DType expected, size_t index, bool copy,
                                      mlx::core::array* out);

// Checks the (not yet evaluated) result `a` of graph output `index` against
// `expected` and the output tensor `t`, and resizes `t` to `a`'s shape.
executorch::runtime::Error prepare_output(const ETTensor& t, const mlx::core::array& a,
                                          fb::DType expected, size_t index);

// Copies the evaluated array `a` into `t` (already resized), in row-major order whatever a's layout.
executorch::runtime::Error copy_output(const ETTensor& t, const mlx::core::array& a,
                                       size_t index);

}  // namespace etmlx
