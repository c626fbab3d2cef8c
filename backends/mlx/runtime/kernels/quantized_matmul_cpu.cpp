// quantized_matmul_cpu (quantized_matmul.h): host loops as lazy graph nodes (host_kernel.h).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <vector>

#include <mlx/ops.h>

#include "kernels/host_kernel.h"
#include "kernels/norms.h"
#include "kernels/quantized_gemm.h"
#include "kernels/quantized_matmul.h"
#include "kernels/quantized_rows.h"
#include "kernels/sigmoid.h"
#include "kernels/thread_pool.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

// Whether a product of m rows goes to a GEMM rather than the few-row dot loop (quantized_rows.h), which
// reads the packed weights once per kMaxRows rows and, per group of 64 values, spends as many
// instructions on each row's float32 terms as on its integer dot product:
// - with integer activations (quantized_gemm_vnni.h) from kMaxRows + 1 rows, where the loop would need a
//   second pass: a Qwen2.5-0.5B-shaped 4-bit model's call over L positions (`etmlx_bench --prompt-len L`,
//   two rounds, ms, GEMM vs loop) 5: 19.0-19.2 vs 22.0-26.0, 6: 19.4-22.3 vs 27.9-30.3, 9 (a --draft-tokens 8
//   verify call): ~24 vs ~34; at 3 and 4 positions the two are within the noise. (One 896 x 4864 linear whose
//   weights stay in cache put the crossover at 6: in a model the weights come from memory);
// - else from 16: W dequantized to float32 tiles (or for BLAS), whose cost pays off only over many rows.
constexpr int kIntegerGemmRows = kMaxRows + 1, kFloatGemmRows = 16;
bool many_rows(int m, int bits, int group, ActivationPrecision p) {
  return m >= (quantized_gemm_integer(bits, group, p) ? kIntegerGemmRows : kFloatGemmRows);
}

ScaleType scale_type(mx::Dtype t) {
  if (t == mx::float16) return ScaleType::f16;
  if (t == mx::bfloat16) return ScaleType::bf16;
  return ScaleType::f32;
}

QuantizedMatrix matrix_of(const std::vector<mx::array>& in, int first, int group, int bits) {
  const mx::array &w = in[first], &s = in[first + 1], &b = in[first + 2];
  return QuantizedMatrix{w.data<uint32_t>(), s.data<void>(), b.data<void>(), scale_type(s.dtype()),
                         static_cast<int>(w.shape(0)), static_cast<int>(w.shape(1)) * 32 / bits, bits, group};
}

// Output rows per task: a few tasks per thread so a slow thread (the machine is shared) does not
// hold up the rest, each with at least kMinTaskWork multiply-adds (about 20 us), so that a small
// product (a tiny model's linear) runs on the calling thread rather than paying to wake a worker.
constexpr int64_t kMinTaskWork = 1 << 16;
int grain_for(int n, int64_t work_per_row) {
  const int64_t least = (kMinTaskWork + work_per_row - 1) / std::max<int64_t>(1, work_per_row);
  return static_cast<int>(std::max<int64_t>({8, n / (4 * pool_threads()), least}));
}

// out [m, N] float32 = x [m, K] float32 . W^T.
void dot_rows(const float* x, int m, const QuantizedMatrix& w, ActivationPrecision p, float* out) {
  PreparedActivations prepared;
  prepared.prepare(x, m, w.k, w.bits, w.group, p);
  auto range = [&](int begin, int end) {
    for (int r0 = 0; r0 < m; r0 += kMaxRows) {
      quantized_dot_rows(w, prepared.rows(r0, std::min(kMaxRows, m - r0)), begin, end,
                         out + static_cast<size_t>(r0) * w.n + begin, w.n);
    }
  };
  parallel_for(w.n, grain_for(w.n, static_cast<int64_t>(w.k) * m), range);
}

// Fused nodes built (etmlx_grouped_linear_nodes: the tests check that fusion happened, or did not).
std::atomic<long long> grouped_nodes{0}, silu_epilogues{0}, matmul_add_norms{0};

}  // namespace

mx::array quantized_matmul_cpu(const mx::array& x, const mx::array& w, const mx::array& scales,
                               const mx::array& biases, int group_size, int bits, ActivationPrecision activations) {
  const mx::Dtype dtype = x.dtype();
  const int k = x.shape(-1), n = w.shape(0);
  const int m = k == 0 ? 0 : static_cast<int>(x.size() / k);
  mx::Shape out_shape = x.shape();
  out_shape.back() = n;
  if (m == 0 || k == 0) return mx::zeros(out_shape, dtype);
  std::vector<mx::array> weights{contiguous_operand(w), contiguous_operand(scales),
                                 contiguous_operand(biases)};
  if (many_rows(m, bits, group_size, activations) &&
      (quantized_gemm_available() || quantized_gemm_integer(bits, group_size, activations))) {
    // Prefill on AVX-512 (W dequantized in tiles per pool thread, or integer activations on VNNI) or with
    // integer activations on AVX2 (quantized_gemm.h).
    const mx::array x32 = mx::reshape(mx::astype(x, mx::float32), {m, k});
    std::vector<mx::array> inputs{mx::contiguous(x32)};
    inputs.insert(inputs.end(), weights.begin(), weights.end());
    auto gemm = [m, group_size, bits, activations](const std::vector<mx::array>& in, mx::array& out) {
      quantized_gemm(in[0].data<float>(), m, matrix_of(in, 1, group_size, bits), activations, out.data<float>());
    };
    const mx::array out32 = host_kernel("QuantizedGemmCpu", {m, n}, mx::float32, std::move(inputs), gemm);
    return mx::astype(mx::reshape(out32, out_shape), dtype);
  }
  if (many_rows(m, bits, group_size, activations)) {
    const mx::array x32 = mx::reshape(mx::astype(x, mx::float32), {m, k});
    auto dequantize = [group_size, bits](const std::vector<mx::array>& in, mx::array& out) {
      const QuantizedMatrix wm = matrix_of(in, 0, group_size, bits);
      // On this thread alone: it is a small part of the product (1/10 of the GEMM's time at 64 rows),
      // and waking the pool here would put its threads next to OpenBLAS's, which busy-wait between
      // GEMMs: with more busy threads than cores, both pools then stall on descheduled threads
      // (measured: a 128-token prefill 0.45 s -> 7-9 s on 2 cores).
      dequantize_rows(wm, 0, wm.n, out.data<float>());
    };
    const mx::array wf = host_kernel("QuantizedDequantizeCpu", {n, k}, mx::float32, std::move(weights), dequantize);
    const mx::array out32 = mx::matmul(x32, mx::transpose(wf));  // float32: MLX sends it to BLAS (blas_route.cpp)
    return mx::astype(mx::reshape(out32, out_shape), dtype);
  }
  // Few rows (decode): x in any shape [..., k] and layout, the result made in its final shape.
  std::vector<mx::array> inputs{mx::astype(x, mx::float32)};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  auto loop = [m, group_size, bits, activations](const std::vector<mx::array>& in, mx::array& out) {
    std::vector<float> copy;
    dot_rows(float_rows(in[0], copy), m, matrix_of(in, 1, group_size, bits), activations, out.data<float>());
  };
  return mx::astype(host_kernel("QuantizedMatmulCpu", out_shape, mx::float32, std::move(inputs), loop), dtype);
}

std::vector<mx::array> quantized_matmul_add_rms_norm_cpu(const mx::array& x, const mx::array& w, const mx::array& scales,
                                                         const mx::array& biases, int group_size, int bits,
                                                         const mx::array& residual, const std::optional<mx::array>& weight,
                                                         float eps, ActivationPrecision activations) {
  if (x.dtype() != mx::float32 || residual.dtype() != mx::float32 || x.ndim() == 0) return {};
  const int k = x.shape(-1), n = w.shape(0);
  const int m = k == 0 ? 0 : static_cast<int>(x.size() / k);
  mx::Shape out_shape = x.shape();
  out_shape.back() = n;
  if (m == 0 || many_rows(m, bits, group_size, activations) || residual.shape() != out_shape) return {};
  if (weight && (weight->dtype() != mx::float32 || weight->ndim() != 1 || weight->shape(0) != n ||
                 weight->status() != mx::array::Status::available || !weight->flags().row_contiguous)) {
    return {};
  }
  std::vector<mx::array> inputs{x, contiguous_operand(w), contiguous_operand(scales),
                                contiguous_operand(biases), residual};
  if (weight) inputs.push_back(*weight);
  auto loop = [m, n, group_size, bits, eps, activations](const std::vector<mx::array>& in,
                                                         std::vector<mx::array>& out) {
    std::vector<float> copy, res_copy;
    float* p = out[0].data<float>();
    dot_rows(float_rows(in[0], copy), m, matrix_of(in, 1, group_size, bits), activations, p);
    // Then, on this thread, as the Add and RmsNorm nodes would: one float32 add each, the norm's row loop.
    const float* r = float_rows(in[4], res_copy);
    float* sum = out[1].data<float>();
    const size_t size = static_cast<size_t>(m) * n;
    for (size_t i = 0; i < size; ++i) sum[i] = r[i] + p[i];
    const float* nw = in.size() > 5 ? in[5].data<float>() : nullptr;
    for (int row = 0; row < m; ++row) rms_norm_row_f32(sum + static_cast<size_t>(row) * n, 1, n, nw, eps,
                                                     out[2].data<float>() + static_cast<size_t>(row) * n);
  };
  matmul_add_norms.fetch_add(1, std::memory_order_relaxed);
  return host_kernel_multi("QuantizedMatmulAddRmsNormCpu", {out_shape, out_shape, out_shape}, mx::float32,
                           std::move(inputs), loop);
}

std::vector<mx::array> quantized_matmul_group_cpu(const mx::array& x, const std::vector<QuantizedLinear>& group,
                                                  int group_size, int bits, bool silu_mul,
                                                  ActivationPrecision activations) {
  if (x.dtype() != mx::float32 || group.empty()) return {};
  const int k = x.ndim() == 0 ? 0 : x.shape(-1);
  const int m = k == 0 ? 0 : static_cast<int>(x.size() / k);
  if (m == 0 || many_rows(m, bits, group_size, activations)) return {};
  // Operands: x, then per linear w, scales, biases and its bias when it has one.
  std::vector<mx::array> inputs{x};
  std::vector<mx::Shape> shapes;
  std::vector<int> first, with_bias;  // per linear: its w's index in inputs; whether a bias follows
  int total = 0;
  for (const QuantizedLinear& l : group) {
    if (l.bias && l.bias->dtype() != mx::float32) return {};
    first.push_back(static_cast<int>(inputs.size()));
    with_bias.push_back(l.bias.has_value());
    inputs.push_back(contiguous_operand(l.w));
    inputs.push_back(contiguous_operand(l.scales));
    inputs.push_back(contiguous_operand(l.biases));
    if (l.bias) inputs.push_back(contiguous_operand(*l.bias));
    mx::Shape shape = x.shape();
    shape.back() = l.w.shape(0);
    shapes.push_back(std::move(shape));
    total += l.w.shape(0);
  }
  // The gated MLP's epilogue (see the header): only where sigmoid_cpu's own loop is what the Sigmoid
  // node would run (the probe computes nothing).
  const bool silu = silu_mul && group.size() == 2 && group[0].w.shape(0) == group[1].w.shape(0) &&
                    sigmoid_f32_host(nullptr, nullptr, 0);
  if (silu) shapes.insert(shapes.end(), 3, shapes[0]);
  // The views' copies: for each, its reshaped shape, its perm and its transposed shape.
  std::vector<int> viewed;  // linears with a view, in order
  std::vector<std::vector<int>> perms;
  for (size_t i = 0; i < group.size(); ++i) {
    const QuantizedLinear& l = group[i];
    if (!l.view_shape) continue;
    mx::Shape t;
    for (int p : l.view_perm) t.push_back((*l.view_shape)[p]);
    viewed.push_back(static_cast<int>(i));
    perms.push_back(l.view_perm);
    shapes.push_back(*l.view_shape);
    shapes.push_back(std::move(t));
  }
  auto loop = [m, k, total, group_size, bits, first, with_bias, silu, viewed, perms, activations](
                  const std::vector<mx::array>& in, std::vector<mx::array>& out) {
    std::vector<QuantizedMatrix> ws;
    for (int f : first) ws.push_back(matrix_of(in, f, group_size, bits));
    std::vector<float> copy;
    const float* xr = float_rows(in[0], copy);
    // As dot_rows, x prepared once for every matrix; the pool splits the concatenated output rows.
    PreparedActivations prepared;
    prepared.prepare(xr, m, k, bits, group_size, activations);
    auto range = [&](int begin, int end) {
      for (size_t i = 0, offset = 0; i < ws.size() && static_cast<int>(offset) < end; offset += ws[i].n, ++i) {
        const int lo = std::max(begin, static_cast<int>(offset)) - static_cast<int>(offset);
        const int hi = std::min(end, static_cast<int>(offset) + ws[i].n) - static_cast<int>(offset);
        if (lo >= hi) continue;
        float* o = out[i].data<float>();
        for (int r0 = 0; r0 < m; r0 += kMaxRows) {
          quantized_dot_rows(ws[i], prepared.rows(r0, std::min(kMaxRows, m - r0)), lo, hi,
                             o + static_cast<size_t>(r0) * ws[i].n + lo, ws[i].n);
        }
        if (with_bias[i]) {
          // One float32 add per output, as mx::add of the [N] bias does after the product.
          const float* b = in[first[i] + 3].data<float>();
          for (int r = 0; r < m; ++r) {
            float* row = o + static_cast<size_t>(r) * ws[i].n;
            for (int j = lo; j < hi; ++j) row[j] = row[j] + b[j];
          }
        }
      }
    };
    parallel_for(total, grain_for(total, static_cast<int64_t>(k) * m), range);
    if (silu) {
      // After every product is done: gate and up rows were split among the threads independently.
      const int64_t size = static_cast<int64_t>(out[0].size());
      const float *g = out[0].data<float>(), *u = out[1].data<float>();
      float *s = out[2].data<float>(), *gs = out[3].data<float>(), *h = out[4].data<float>();
      sigmoid_f32_host(g, s, size);
      for (int64_t i = 0; i < size; ++i) gs[i] = g[i] * s[i];  // one float32 multiply each, as mx::multiply
      for (int64_t i = 0; i < size; ++i) h[i] = gs[i] * u[i];
    }
    size_t next = ws.size() + (silu ? 3 : 0);
    for (size_t v = 0; v < viewed.size(); ++v, next += 2) {
      const mx::array& y = out[viewed[v]];
      std::copy(y.data<float>(), y.data<float>() + y.size(), out[next].data<float>());
      transpose_copy(y.data<float>(), out[next].shape(), perms[v], out[next + 1].data<float>());
    }
  };
  grouped_nodes.fetch_add(1, std::memory_order_relaxed);
  if (silu) silu_epilogues.fetch_add(1, std::memory_order_relaxed);
  return host_kernel_multi("QuantizedMatmulGroupCpu", std::move(shapes), mx::float32, std::move(inputs), loop);
}

}  // namespace etmlx::kernels

// For `backends.mlx.runtime.kernels_info()` (benchmarks and tests say what they measured).
extern "C" __attribute__((visibility("default"))) const char* etmlx_quantized_rows_isa() {
  return etmlx::kernels::quantized_rows_isa();
}

// The few-row loop's activation precision for the usual layout (4 bits, group 64) on this CPU, in a program
// exported with the default (int16) activations.
extern "C" __attribute__((visibility("default"))) const char* etmlx_quantized_activations() {
  using etmlx::kernels::ActivationPrecision;
  return etmlx::kernels::activation_precision_name(etmlx::kernels::rows_precision(4, 64, ActivationPrecision::int16));
}

// The many-row product's (prefill's) for the same layout: integer only where an integer GEMM runs (AVX-512 VNNI, AVX2).
extern "C" __attribute__((visibility("default"))) const char* etmlx_quantized_gemm_activations() {
  return etmlx::kernels::quantized_gemm_integer(4, 64, etmlx::kernels::ActivationPrecision::int16) ? "int16"
                                                                                                 : "float32";
}

extern "C" __attribute__((visibility("default"))) long long etmlx_grouped_linear_nodes() {
  return etmlx::kernels::grouped_nodes.load();
}

extern "C" __attribute__((visibility("default"))) long long etmlx_silu_epilogues() {
  return etmlx::kernels::silu_epilogues.load();
}

extern "C" __attribute__((visibility("default"))) long long etmlx_matmul_add_rms_norm_nodes() {
  return etmlx::kernels::matmul_add_norms.load();
}

extern "C" __attribute__((visibility("default"))) int etmlx_cpu_threads() { return etmlx::kernels::pool_threads(); }
