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
// float32 products with one output column go to sgemv (see below).
// Not built on Apple platforms, where MLX uses Accelerate.

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <cblas.h>  // scipy_openblas32's header: scipy_cblas_* prototypes

#include "options.h"

namespace {
// Lets a test (and `etmlx.blas_route.status()`) tell whether MLX's calls
// actually arrive here; one relaxed increment per GEMM is noise next to it.
std::atomic<uint64_t> routed_calls{0};
std::atomic<uint64_t> gemv_calls{0};  // of which went to sgemv
std::atomic<uint64_t> small_calls{0};  // of which ran on one OpenBLAS thread (kOneThreadMacs)

// ETMLX_BLAS=reference sends the calls on to the next definition in the process
// (the BLAS bundled with mlx[cpu]), read once at the first call. Why one would:
// OpenBLAS picks kernels by problem size, so a row of a product can round
// differently depending on how many rows the product has, and a served
// request's logprobs can then differ in the last bit with what it is batched
// with; the reference BLAS sums in one fixed order (~100x slower).
using Sgemm = void (*)(enum CBLAS_ORDER, enum CBLAS_TRANSPOSE, enum CBLAS_TRANSPOSE, blasint, blasint, blasint,
                       float, const float*, blasint, const float*, blasint, float, float*, blasint);
using Dgemm = void (*)(enum CBLAS_ORDER, enum CBLAS_TRANSPOSE, enum CBLAS_TRANSPOSE, blasint, blasint, blasint,
                       double, const double*, blasint, const double*, blasint, double, double*, blasint);
using Cgemm = void (*)(enum CBLAS_ORDER, enum CBLAS_TRANSPOSE, enum CBLAS_TRANSPOSE, blasint, blasint, blasint,
                       const void*, const void*, blasint, const void*, blasint, const void*, void*, blasint);

struct Reference {
  bool on = false;
  Sgemm sgemm = nullptr;
  Dgemm dgemm = nullptr;
  Cgemm cgemm = nullptr;
};

const Reference& reference() {
  static const Reference r = [] {
    Reference out;
    if (!etmlx::options::process().blas_reference) return out;  // ETMLX_BLAS=reference
    // libmlx's own dependency tree holds its BLAS (which may not be in the
    // global scope: Python loads mlx privately); this library is not in it.
    void* scope = dlopen("libmlx.so", RTLD_NOW | RTLD_NOLOAD);
    if (scope == nullptr) scope = RTLD_NEXT;
    out.sgemm = reinterpret_cast<Sgemm>(dlsym(scope, "cblas_sgemm"));
    out.dgemm = reinterpret_cast<Dgemm>(dlsym(scope, "cblas_dgemm"));
    out.cgemm = reinterpret_cast<Cgemm>(dlsym(scope, "cblas_cgemm"));
    // (The handle is kept: libmlx stays loaded for the life of the process anyway.)
    out.on = out.sgemm && out.dgemm && out.cgemm;
    if (!out.on) {
      std::fprintf(stderr, "etmlx: ETMLX_BLAS=reference but no other cblas_sgemm/dgemm/cgemm is loaded; "
                           "using OpenBLAS\n");
    }
    return out;
  }();
  return r;
}
}  // namespace

#define ETMLX_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// A product with one output column is a matrix-vector product. OpenBLAS's
// sgemm does not special-case it, and its sgemv streams the matrix 2-4x faster
// on this CPU (measured 2048x768: 0.53 ms vs 0.15 ms; 32000x768: 10.2 vs 4.5),
// which is most of a decode step: the interpreter writes one-row linears in
// this form (runtime/cpu_gemm.cpp). One output *row* is left to sgemm on
// purpose: attention's per-head products have one row whenever a call decodes
// one token, and giving them another summation order than the same products in
// a longer call would make a served request's bits depend on its batch.
bool sgemm_as_sgemv(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE trans_a,
                    const enum CBLAS_TRANSPOSE trans_b, const blasint m, const blasint n,
                    const blasint k, const float alpha, const float* a, const blasint lda,
                    const float* b, const blasint ldb, const float beta, float* c,
                    const blasint ldc) {
  if (order != CblasRowMajor || k < 1 || n != 1 || m < 2) return false;
  gemv_calls.fetch_add(1, std::memory_order_relaxed);
  // c[:, 0] (m, stride ldc) = alpha * op(a) x + beta * c, x = op(b)[:, 0] (k).
  // op(a) is m x k: stored k x m when transposed, m x k otherwise.
  const blasint incx = trans_b != CblasNoTrans ? 1 : ldb;
  if (trans_a != CblasNoTrans) {
    scipy_cblas_sgemv(CblasRowMajor, CblasTrans, k, m, alpha, a, lda, b, incx, beta, c, ldc);
  } else {
    scipy_cblas_sgemv(CblasRowMajor, CblasNoTrans, m, k, alpha, a, lda, b, incx, beta, c, ldc);
  }
  return true;
}

// Products under this many multiply-adds run on the calling thread alone. OpenBLAS's workers spin
// (sched_yield) for ~0.1 s after every threaded call; on a 2-core machine they then take a core from the
// etmlx kernel pool for the quantized linears that follow. A quantized prefill's only float products are
// attention's per-head ones (at 512 tokens: 512 x 64 x 512, 1.7e7), each too small to gain from a second
// thread. Measured (qwen2.5-0.5b int4, 512-token prefill, 2 cores): OpenBLAS's spinning workers took ~50%
// of the CPU samples.
constexpr double kOneThreadMacs = 1 << 26;

// OpenBLAS's own thread count, read before the first change.
int openblas_threads() {
  static const int n = scipy_openblas_get_num_threads();
  return n;
}

}  // namespace

ETMLX_EXPORT void cblas_sgemm(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE trans_a,
                              const enum CBLAS_TRANSPOSE trans_b, const blasint m, const blasint n,
                              const blasint k, const float alpha, const float* a, const blasint lda,
                              const float* b, const blasint ldb, const float beta, float* c,
                              const blasint ldc) {
  routed_calls.fetch_add(1, std::memory_order_relaxed);
  if (reference().on) return reference().sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (sgemm_as_sgemv(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) return;
  const int threads = openblas_threads();
  if (threads > 1 && static_cast<double>(m) * n * k < kOneThreadMacs) {
    // A concurrent large product may run on one thread meanwhile: only its speed changes, never its bits
    // beyond what OpenBLAS's own size-based choices already change.
    small_calls.fetch_add(1, std::memory_order_relaxed);
    scipy_openblas_set_num_threads(1);
    scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    scipy_openblas_set_num_threads(threads);
    return;
  }
  scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

ETMLX_EXPORT void cblas_dgemm(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE trans_a,
                              const enum CBLAS_TRANSPOSE trans_b, const blasint m, const blasint n,
                              const blasint k, const double alpha, const double* a,
                              const blasint lda, const double* b, const blasint ldb,
                              const double beta, double* c, const blasint ldc) {
  routed_calls.fetch_add(1, std::memory_order_relaxed);
  if (reference().on) return reference().dgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  scipy_cblas_dgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

ETMLX_EXPORT void cblas_cgemm(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE trans_a,
                              const enum CBLAS_TRANSPOSE trans_b, const blasint m, const blasint n,
                              const blasint k, const void* alpha, const void* a, const blasint lda,
                              const void* b, const blasint ldb, const void* beta, void* c,
                              const blasint ldc) {
  routed_calls.fetch_add(1, std::memory_order_relaxed);
  if (reference().on) return reference().cgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  scipy_cblas_cgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

ETMLX_EXPORT uint64_t etmlx_blas_routed_calls() {
  return routed_calls.load(std::memory_order_relaxed);
}

ETMLX_EXPORT uint64_t etmlx_blas_gemv_calls() { return gemv_calls.load(std::memory_order_relaxed); }

ETMLX_EXPORT uint64_t etmlx_blas_one_thread_calls() { return small_calls.load(std::memory_order_relaxed); }

ETMLX_EXPORT const char* etmlx_blas_library() {
  return reference().on ? "MLX's bundled reference BLAS (ETMLX_BLAS=reference)" : scipy_openblas_get_config();
}
