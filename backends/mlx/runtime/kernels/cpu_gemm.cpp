#include "kernels/cpu_gemm.h"

#include <cstring>
#include <optional>

#include <mlx/ops.h>
#include <mlx/primitives.h>

#include "kernels/host_kernel.h"

#ifdef ETMLX_CBLAS_ROUTE
// The cblas_sgemm MLX's own CPU matmul calls: libetmlx_blas's (blas_route.cpp), which this library is linked
// against ahead of libmlx. Declared here (not from a BLAS header): only this one function is called.
extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                            int lda, const float* b, int ldb, float beta, float* c, int ldc);
#endif

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
//
// b^T is the weight itself when b is the graph's transpose of a loaded weight (a linear's [out, in] matrix, as
// nn.Linear stores it): that array is used as it is, so neither transpose becomes a graph node (each is a task
// on the CPU stream, a real share of a small model's step). The product reads the same memory either way. (By
// name: libmlx does not export its primitives' type information.)
std::optional<mx::array> loaded_weight(const mx::array& b) {
  if (b.has_primitive() && b.ndim() == 2 && std::strcmp(b.primitive().name(), "Transpose") == 0) {
    const auto& axes = static_cast<const mx::Transpose&>(b.primitive()).state();
    const mx::array& w = b.inputs()[0];
    if (axes.size() == 2 && axes[0] == 1 && axes[1] == 0 && w.status() == mx::array::Status::available &&
        w.flags().row_contiguous) {
      return w;
    }
  }
  return std::nullopt;
}

#ifdef ETMLX_CBLAS_ROUTE
// Products of float32 rows by a loaded weight as one graph node each, making the very cblas_sgemm call MLX's
// Matmul makes for them (mlx/backend/cpu/matmul.cpp, gemms/cblas.cpp: RowMajor, alpha 1, beta 0), so the same
// bits, without the reshapes and the transpose MLX's matmul puts around it. The rows are read in place when
// row-contiguous (float_rows), as MLX's flatten would leave them.
enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };

// One row, written as W @ x^T (M = out, N = 1, lda = in, ldb = ldc = 1): one output column, which the route
// sends to sgemv. Three nodes around the product -> one.
mx::array linear_row(const mx::array& x, const mx::array& w, mx::Shape shape) {
  const int k = w.shape(1), n = w.shape(0);
  auto loop = [k, n](const std::vector<mx::array>& in, mx::array& out) {
    std::vector<float> copy;
    cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, n, 1, k, 1.0f, in[1].data<float>(), k, float_rows(in[0], copy), 1,
                0.0f, out.data<float>(), 1);
  };
  return host_kernel("LinearRowCpu", std::move(shape), mx::float32, {x, w}, std::move(loop));
}

// m rows (a prefill, a draft program's verified positions, a batch): x [m, in] @ W^T, W passed transposed
// (M = m, N = out, K = in, lda = ldb = in, ldc = out). The transpose, flatten, product and unflatten -> one node.
mx::array linear_rows(const mx::array& x, const mx::array& w) {
  const int k = w.shape(1), n = w.shape(0), m = static_cast<int>(x.size() / k);
  mx::Shape shape = x.shape();
  shape.back() = n;
  auto loop = [m, k, n](const std::vector<mx::array>& in, mx::array& out) {
    std::vector<float> copy;
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, m, n, k, 1.0f, float_rows(in[0], copy), k, in[1].data<float>(), k,
                0.0f, out.data<float>(), n);
  };
  return host_kernel("LinearRowsCpu", std::move(shape), mx::float32, {x, w}, std::move(loop));
}
#endif

mx::array matmul_f(const mx::array& a, const mx::array& b) {
  const std::optional<mx::array> w = loaded_weight(b);
  if (!one_row_float32(a, b)) {
#ifdef ETMLX_CBLAS_ROUTE
    if (w && a.dtype() == mx::float32 && w->dtype() == mx::float32 && a.ndim() >= 2 && a.shape(-1) == b.shape(0) &&
        a.shape(-1) > 0 && a.size() > 0) {
      return linear_rows(a, *w);
    }
#endif
    return mx::matmul(a, b);
  }
  auto shape = a.shape();
  shape.back() = b.shape(1);
#ifdef ETMLX_CBLAS_ROUTE
  if (w) return linear_row(a, *w, std::move(shape));
#endif
  return mx::reshape(mx::matmul(w ? *w : mx::transpose(b), mx::reshape(a, {a.shape(-1), 1})), shape);
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
