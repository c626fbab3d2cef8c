#include "kernels/cpu_gemm.h"

#include <mlx/ops.h>

namespace mx = mlx::core;

namespace etmlx::kernels {
namespace {

bool both_half(const mx::array& a, const mx::array& b) {
  auto half = [](mx::Dtype t) { return t == mx::float16 || t == mx::bfloat16; };
  return a.dtype() == b.dtype() && half(a.dtype());
}

// A single row times a matrix (a linear layer in a one-row decode step).
bool one_row_float32(const mx::array& a, const mx::array& b) {
  return a.dtype() == mx::float32 && b.dtype() == mx::float32 &&
         a.ndim() >= 1 && b.ndim() == 2 && a.size() == static_cast<size_t>(a.shape(-1)) &&
         a.shape(-1) == b.shape(0) && b.shape(1) > 1;
}

// a @ b, with one-row float32 products written as b^T @ a^T: a
// product with one output *column*, which libetmlx_blas sends to sgemv (2-4x
// faster there). Only linears become such products: attention's per-head
// products have more than one output column, so their rounding never depends on
// how many query rows a call has (which keeps a served request's bits
// independent of the requests batched with it).
mx::array matmul_f(const mx::array& a, const mx::array& b) {
  if (!one_row_float32(a, b)) return mx::matmul(a, b);
  auto shape = a.shape();
  shape.back() = b.shape(1);
  return mx::reshape(mx::matmul(mx::transpose(b), mx::reshape(a, {a.shape(-1), 1})), shape);
}

mx::array addmm_f(const mx::array& bias, const mx::array& a, const mx::array& b, float alpha, float beta) {
  if (!one_row_float32(a, b) || bias.dtype() != mx::float32) return mx::addmm(bias, a, b, alpha, beta);
  mx::array product = matmul_f(a, b);
  if (alpha != 1.0f) product = mx::multiply(product, mx::array(alpha, mx::float32));
  return mx::add(beta == 1.0f ? bias : mx::multiply(bias, mx::array(beta, mx::float32)), product);
}

// A half-precision activation times a weight widened to float32 at load (cpu_weights.h).
bool half_times_widened(const mx::array& a, const mx::array& b) {
  return (a.dtype() == mx::float16 || a.dtype() == mx::bfloat16) && b.dtype() == mx::float32;
}

}  // namespace

mx::array cpu_matmul(const mx::array& a, const mx::array& b) {
  if (half_times_widened(a, b)) return mx::astype(matmul_f(mx::astype(a, mx::float32), b), a.dtype());
  if (!both_half(a, b)) return matmul_f(a, b);
  return mx::astype(matmul_f(mx::astype(a, mx::float32), mx::astype(b, mx::float32)), a.dtype());
}

mx::array cpu_addmm(const mx::array& bias, const mx::array& a, const mx::array& b, float alpha,
                       float beta) {
  if (half_times_widened(a, b) && bias.dtype() == a.dtype()) {
    return mx::astype(addmm_f(mx::astype(bias, mx::float32), mx::astype(a, mx::float32), b, alpha, beta),
                      a.dtype());
  }
  if (!both_half(a, b) || bias.dtype() != a.dtype()) return addmm_f(bias, a, b, alpha, beta);
  return mx::astype(addmm_f(mx::astype(bias, mx::float32), mx::astype(a, mx::float32),
                            mx::astype(b, mx::float32), alpha, beta),
                    a.dtype());
}

}  // namespace etmlx::kernels
