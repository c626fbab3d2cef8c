#include "quantized_layout.h"

#include <string>

#include "dtypes.h"

namespace etmlx {

namespace mx = mlx::core;

bool check_quantized_params(int group_size, int bits, std::string* error) {
  if (bits != 4 && bits != 8) {
    *error = "bits " + std::to_string(bits) + " is not supported (4 or 8)";
    return false;
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    *error = "group size " + std::to_string(group_size) + " is not supported (32, 64 or 128)";
    return false;
  }
  return true;
}

namespace {

std::string shape_str(const mx::array& a) {
  std::string s = "[";
  for (int i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

}  // namespace

bool check_quantized_layout(const mx::array& w, const mx::array& scales, const mx::array& biases,
                            int group_size, int bits, int* in_features, std::string* error, int ndim) {
  if (!check_quantized_params(group_size, bits, error)) return false;
  if (w.dtype() != mx::uint32 || w.ndim() != ndim) {
    *error = "packed weights must be a " + std::to_string(ndim) + "-d uint32 tensor, got " +
             mlx_dtype_name(w.dtype()) + " " + shape_str(w);
    return false;
  }
  if (!mx::issubdtype(scales.dtype(), mx::floating) || scales.dtype() != biases.dtype()) {
    *error = std::string("scales and biases must share one floating dtype, got ") +
             mlx_dtype_name(scales.dtype()) + " and " + mlx_dtype_name(biases.dtype());
    return false;
  }
  const long long k = static_cast<long long>(w.shape(-1)) * 32 / bits;
  bool leading_match = scales.ndim() == ndim;
  std::string want = "[";
  for (int i = 0; i + 1 < ndim; ++i) {
    leading_match = leading_match && scales.shape(i) == w.shape(i);
    want += std::to_string(w.shape(i)) + ", ";
  }
  want += std::to_string(k / group_size) + "]";
  if (!leading_match || scales.shape() != biases.shape() || k % group_size != 0 ||
      scales.shape(-1) != k / group_size) {
    *error = "weights " + shape_str(w) + " at " + std::to_string(bits) + " bits and group size " +
             std::to_string(group_size) + " need scales and biases " + want + ", got " + shape_str(scales) +
             " and " + shape_str(biases);
    return false;
  }
  *in_features = static_cast<int>(k);
  return true;
}

}  // namespace etmlx
