// A constant whose bytes are ExecuTorch named data (the .pte's segments or an
// external .ptd), wrapped as an mlx array.
#pragma once

#include <cstddef>
#include <cstdint>

#include <executorch/runtime/core/named_data_map.h>
#include <mlx/array.h>

namespace etmlx {

// Fetches `key` from `named` and builds constant `index` (shape, dtype, `nbytes`
// = its element count times the item size). The array aliases the mapped bytes
// when they are aligned to the item size (the deleter keeps the FreeableBuffer,
// and with it the mapping, alive), and is a private copy otherwise. A null map,
// a missing key or a size that disagrees with the shape logs one "etmlx: ..."
// line and returns false.
bool named_constant(const executorch::runtime::NamedDataMap* named, const char* key, size_t index,
                    uint64_t nbytes, size_t itemsize, mlx::core::Shape shape, mlx::core::Dtype dtype,
                    mlx::core::array* out);

}  // namespace etmlx
