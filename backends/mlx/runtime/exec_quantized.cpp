// The quantized-weight nodes (QuantizedLinearNode, QuantizedEmbeddingNode) over MLX's affine
// packed weights, operands checked on every call (quantized_layout.h) since the kernels read the
// packed words by the sizes the scales imply. The linear runs the kernel set's quantized matmul
// (kernels/quantized_matmul.h), the embedding MLX's dequantize of the rows looked up.
#include <string>

#include <mlx/ops.h>

#include "dtypes.h"
#include "interpreter.h"
#include "quantized_layout.h"

namespace etmlx {

namespace mx = mlx::core;

bool Interpreter::read_quantized_weights(const fb::Tid* w, const fb::Tid* scales, const fb::Tid* biases,
                                         int group_size, int bits, const mx::array** w_out,
                                         const mx::array** scales_out, const mx::array** biases_out,
                                         int* columns, int ndim) {
  *w_out = read(w);
  if (!*w_out) return false;
  *scales_out = read(scales);
  if (!*scales_out) return false;
  *biases_out = read(biases);
  if (!*biases_out) return false;
  std::string error;
  if (!check_quantized_layout(**w_out, **scales_out, **biases_out, group_size, bits, columns, &error, ndim)) {
    return fail("%s", error.c_str());
  }
  return true;
}

bool Interpreter::exec_quantized_linear(const fb::QuantizedLinearNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  const mx::array *w = nullptr, *scales = nullptr, *biases = nullptr;
  int k = 0;
  if (!read_quantized_weights(n.w(), n.scales(), n.biases(), n.group_size(), n.bits(), &w, &scales, &biases, &k))
    return false;
  if (x->ndim() < 1 || x->shape(-1) != k) {
    return fail("input's last size must be the weights' %d input features", k);
  }
  if (biases->dtype() != scales->dtype()) {
    return fail("biases are %s but the scales are %s", mlx_dtype_name(biases->dtype()),
                mlx_dtype_name(scales->dtype()));
  }
  // As mx::quantized_matmul does, the product is in the promoted type of the input and the scales: float32
  // activations over bfloat16 scales (what mlx_lm.convert -q writes for a bf16 checkpoint) multiply in float32.
  const mx::Dtype compute = mx::promote_types(x->dtype(), scales->dtype());
  const mx::array input = x->dtype() == compute ? *x : mx::astype(*x, compute);
  mx::array out = program_.kernels->quantized_matmul(input, *w, *scales, *biases, n.group_size(), n.bits());
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
  const mx::array *w = nullptr, *scales = nullptr, *biases = nullptr;
  int d = 0;
  if (!read_quantized_weights(n.w(), n.scales(), n.biases(), n.group_size(), n.bits(), &w, &scales, &biases, &d))
    return false;
  mx::array rows = *indices;
  if (!safe_indices(*indices, w->shape(0), "indices", &rows)) return false;
  // Gather the packed rows and their scales first: only the looked-up rows are dequantized.
  mx::array out = mx::dequantize(mx::take(*w, rows, 0), mx::take(*scales, rows, 0),
                                 mx::take(*biases, rows, 0), n.group_size(), n.bits(), "affine");
  return write(n.out(), std::move(out));
}

}  // namespace etmlx
