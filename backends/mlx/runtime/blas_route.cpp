// libetmlx_blas: routes MLX's CPU GEMM calls to OpenBLAS.
//
// Why: the Linux `mlx[cpu]` wheel links the reference (netlib) BLAS, whose
// sgemm runs at ~1.5 GFLOP/s here, about 1/100 of an optimized kernel; every
// float32 matmul MLX runs on the CPU goes through cblas_sgemm. MLX leaves those
// symbols undefined and binds them lazily, so a library that defines them and
// sits earlier in the process's global symbol scope (loaded with RTLD_GLOBAL
// before MLX's first matmul, or linked ahead of libmlx) receives the calls.
// The OpenBLAS we forward to (pip `scipy-openblas32`) prefixes its symbols
// with `scipy_`, so it never collides with anything else in the process.
//
// Only the three GEMMs MLX calls are routed; LAPACK stays where it was.
// float32 products with one output row or column go to sgemv (see below).
// Not built on Apple platforms, where MLX uses Accelerate.

#include <atomic>
#include <cstdint>

#include <cblas.h>  // scipy_openblas32's header: scipy_cblas_* prototypes

namespace {
// Lets a test (and `etmlx.blas_route.status()`) tell whether MLX's calls
// actually arrive here; one relaxed increment per GEMM is noise next to it.
std::atomic<uint64_t> routed_calls{0};
}  // namespace

#define ETMLX_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// A product with one output row or column is a matrix-vector product. OpenBLAS's
// sgemm does not special-case it, and its sgemv streams the matrix 2-4x faster
// on this CPU (measured 768x2048: 0.53 ms vs 0.15 ms; 32000x768: 10.2 vs 4.5),
// which is most of a decode step. Returns false for shapes it does not cover.
bool sgemm_as_sgemv(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE trans_a,
                    const enum CBLAS_TRANSPOSE trans_b, const blasint m, const blasint n,
                    const blasint k, const float alpha, const float* a, const blasint lda,
                    const float* b, const blasint ldb, const float beta, float* c,
                    const blasint ldc) {
  if (order != CblasRowMajor || k < 1 || (m != 1 && n != 1)) return false;
  const bool a_t = trans_a != CblasNoTrans;
  const bool b_t = trans_b != CblasNoTrans;
  if (m == 1) {
    // c[0, :] (n) = alpha * op(b)^T x + beta * c, x = op(a)[0, :] (k).
    // op(b) is k x n: stored n x k when transposed, k x n otherwise.
    const blasint incx = a_t ? lda : 1;
    if (b_t) {
      scipy_cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, alpha, b, ldb, a, incx, beta, c, 1);
    } else {
      scipy_cblas_sgemv(CblasRowMajor, CblasTrans, k, n, alpha, b, ldb, a, incx, beta, c, 1);
    }
    return true;
  }
  // n == 1: c[:, 0] (m, stride ldc) = alpha * op(a) x + beta * c, x = op(b)[:, 0] (k).
  // op(a) is m x k: stored k x m when transposed, m x k otherwise.
  const blasint incx = b_t ? 1 : ldb;
  if (a_t) {
    scipy_cblas_sgemv(CblasRowMajor, CblasTrans, k, m, alpha, a, lda, b, incx, beta, c, ldc);
  } else {
    scipy_cblas_sgemv(CblasRowMajor, CblasNoTrans, m, k, alpha, a, lda, b, incx, beta, c, ldc);
  }
  return true;
}

}  // namespace

ETMLX_EXPORT void cblas_sgemm(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE trans_a,
                              const enum CBLAS_TRANSPOSE trans_b, const blasint m, const blasint n,
                              const blasint k, const float alpha, const float* a, const blasint lda,
                              const float* b, const blasint ldb, const float beta, float* c,
                              const blasint ldc) {
  routed_calls.fetch_add(1, std::memory_order_relaxed);
  if (sgemm_as_sgemv(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) return;
  scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

ETMLX_EXPORT void cblas_dgemm(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE trans_a,
                              const enum CBLAS_TRANSPOSE trans_b, const blasint m, const blasint n,
                              const blasint k, const double alpha, const double* a,
                              const blasint lda, const double* b, const blasint ldb,
                              const double beta, double* c, const blasint ldc) {
  routed_calls.fetch_add(1, std::memory_order_relaxed);
  scipy_cblas_dgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

ETMLX_EXPORT void cblas_cgemm(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE trans_a,
                              const enum CBLAS_TRANSPOSE trans_b, const blasint m, const blasint n,
                              const blasint k, const void* alpha, const void* a, const blasint lda,
                              const void* b, const blasint ldb, const void* beta, void* c,
                              const blasint ldc) {
  routed_calls.fetch_add(1, std::memory_order_relaxed);
  scipy_cblas_cgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

ETMLX_EXPORT uint64_t etmlx_blas_routed_calls() {
  return routed_calls.load(std::memory_order_relaxed);
}

ETMLX_EXPORT const char* etmlx_blas_library() { return scipy_openblas_get_config(); }
