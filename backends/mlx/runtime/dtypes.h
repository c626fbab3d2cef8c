// Mapping between the blob's fb::DType, mlx::core::Dtype and ExecuTorch's
// ScalarType. Every function here is total over its input: an out-of-range
// fb::DType gives std::nullopt / false / "?" rather than undefined behaviour.
#pragma once

#include <cstddef>
#include <optional>

#include <executorch/runtime/core/portable_type/scalar_type.h>
#include <mlx/dtype.h>

#include "schema_generated.h"

namespace etmlx {

namespace fb = backends::mlx::serialization::generated::fb;
using ETScalarType = executorch::runtime::etensor::ScalarType;

bool dtype_in_range(fb::DType d);
const char* dtype_name(fb::DType d);
std::optional<mlx::core::Dtype> to_mlx(fb::DType d);
std::optional<ETScalarType> to_et(fb::DType d);
std::optional<fb::DType> from_mlx(mlx::core::Dtype d);
// Bytes per element of `d`, 0 if `d` is out of range.
size_t dtype_itemsize(fb::DType d);
// Human readable name of an mlx dtype (for error messages).
const char* mlx_dtype_name(mlx::core::Dtype d);

}  // namespace etmlx
