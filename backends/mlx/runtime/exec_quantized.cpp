// The quantized-weight nodes (QuantizedLinearNode, QuantizedEmbeddingNode): MLX's own affine
// kernels over the packed weights, operands checked on every call (quantized_layout.h) since
// mlx::core reads the packed words by the sizes the scales imply.
#include <string>

#include <mlx/ops.h>

#include "dtypes.h"
#include "interpreter.h"
#include "quantized_layout.h"

namespace etmlx {

namespace mx = mlx::core;

bool Interpreter::exec_quantized_linear(const fb::QuantizedLinearNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  const mx::array* w = read(n.w());
  if (!w) return false;
  const mx::array* scales = read(n.scales());
  if (!scales) return false;
  const mx::array* biases = read(n.biases());
  if (!biases) return false;
  int k = 0;
  std::string error;
  if (!check_quantized_layout(*w, *scales, *biases, n.group_size(), n.bits(), &k, &error)) {
    return fail("%s", error.c_str());
  }
  if (x->ndim() < 1 || x->shape(-1) != k) {
    return fail("input's last size must be the weights' %d input features", k);
  }
  if (x->dtype() != scales->dtype()) {
    return fail("input is %s but the scales are %s", mlx_dtype_name(x->dtype()),
                mlx_dtype_name(scales->dtype()));
  }
  mx::array out = mx::quantized_matmul(*x, *w, *scales, *biases, /*transpose=*/true, n.group_size(),
                                       n.bits(), "affine");
  if (n.bias()) {
    const mx::array* bias = read(n.bias());
    if (!bias) return false;
    if (bias->ndim() != 1 || bias->shape(0) != w->shape(0)) {
      return fail("bias must be 1-d with the %d output features", w->shape(0));
    }
    out = mx::add(out, mx::astype(*bias, out.dtype()));
  }
  return write(n.out(), std::move(out));
}

bool Interpreter::exec_quantized_embedding(const fb::QuantizedEmbeddingNode& n) {
  const mx::array* indices = read(n.indices());
  if (!indices) return false;
  const mx::array* w = read(n.w());
  if (!w) return false;
  const mx::array* scales = read(n.scales());
  if (!scales) return false;
  const mx::array* biases = read(n.biases());
  if (!biases) return false;
  int d = 0;
  std::string error;
  if (!check_quantized_layout(*w, *scales, *biases, n.group_size(), n.bits(), &d, &error)) {
    return fail("%s", error.c_str());
  }
  mx::array rows = *indices;
  if (!safe_indices(*indices, w->shape(0), "indices", &rows)) return false;
  // Gather the packed rows and their scales first: only the looked-up rows are dequantized.
  mx::array out = mx::dequantize(mx::take(*w, rows, 0), mx::take(*scales, rows, 0),
                                 mx::take(*biases, rows, 0), n.group_size(), n.bits(), "affine");
  return write(n.out(), std::move(out));
}

}  // namespace etmlx
