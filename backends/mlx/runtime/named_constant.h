// A constant whose bytes are ExecuTorch named data (the .pte's segments or an
// external .ptd), checked against its checksum and wrapped as an mlx array.
#pragma once

#include <cstddef>
#include <cstdint>

#include <executorch/runtime/core/named_data_map.h>
#include <mlx/array.h>

namespace etmlx {

// Fetches `key` from `named` and builds constant `index` (shape, dtype, `nbytes`
// = its element count times the item size). The key carries the CRC-32 the
// exporter computed (builder/weights.py); the bytes are checked against it
// while they are copied into MLX's allocator (CPU, CUDA), or before they are
// wrapped in place where the allocator can do that (Metal, page-aligned
// bytes). A null map, a missing key, a key without a checksum, a size that
// disagrees with the shape or a checksum mismatch logs one "etmlx: constant N
// (dtype [shape]): named data '<key>' ..." line and returns false.
bool named_constant(const executorch::runtime::NamedDataMap* named, const char* key, size_t index,
                    uint64_t nbytes, mlx::core::Shape shape, mlx::core::Dtype dtype,
                    mlx::core::array* out);

}  // namespace etmlx
