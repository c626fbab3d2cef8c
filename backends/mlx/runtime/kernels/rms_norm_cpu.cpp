// RMSNorm on the CPU kernel set as one host loop. MLX has no CPU kernel for mx::fast::rms_norm: on
// the CPU it expands into its reference ops (square, sum, multiply, add, rsqrt, multiply, multiply
// and their broadcasts), about nine graph nodes per norm, ~440 in a 24-layer decode step, each
// scheduled at a few microseconds. One node computes the same float32 formula.
#include "kernels/norms.h"

#include <atomic>
#include <cmath>
#include <utility>
#include <vector>

#include <mlx/fast.h>

#include "kernels/host_kernel.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

// Offset (in elements) of the first element of row `r` (rows: every index but the last axis).
size_t row_offset(const mx::array& x, size_t r) {
  size_t offset = 0;
  for (int d = static_cast<int>(x.ndim()) - 2; d >= 0; --d) {
    const size_t size = static_cast<size_t>(x.shape(d));
    offset += (r % size) * static_cast<size_t>(x.strides()[d]);
    r /= size;
  }
  return offset;
}

void rms_norm_rows(const std::vector<mx::array>& in, mx::array& out, float eps) {
  const mx::array& x = in[0];
  const int n = x.shape(-1);
  const size_t rows = x.size() / static_cast<size_t>(n);
  const size_t step = static_cast<size_t>(x.strides().back());
  const float* w = in.size() > 1 ? in[1].data<float>() : nullptr;
  const float* base = x.data<float>();
  float* o = out.data<float>();
  for (size_t r = 0; r < rows; ++r) {
    rms_norm_row_f32(base + (x.flags().row_contiguous ? r * n : row_offset(x, r)), step, n, w, eps, o + r * n);
  }
}

// Element i (row-major) of x, any layout.
float element(const mx::array& x, size_t i) {
  size_t at = 0;
  for (int d = static_cast<int>(x.ndim()) - 1; d >= 0; --d) {
    const size_t size = static_cast<size_t>(x.shape(d));
    at += (i % size) * static_cast<size_t>(x.strides()[d]);
    i /= size;
  }
  return x.data<float>()[at];
}

// Fused add-and-norm nodes built (etmlx_add_rms_norm_nodes, for the tests).
std::atomic<long long> add_norm_nodes{0};

bool weight_ready(const std::optional<mx::array>& weight) {
  return !weight || (weight->dtype() == mx::float32 && weight->ndim() == 1 &&
                     weight->status() == mx::array::Status::available && weight->flags().row_contiguous);
}

}  // namespace

// One row: x * rsqrt(mean(x^2) + eps), then times the weight. Shared by both nodes below, so the
// fused add-and-norm gives the bits of the norm alone.
__attribute__((noinline)) void rms_norm_row_f32(const float* xr, size_t step, int n, const float* w, float eps, float* orow) {
  constexpr int kLanes = 16;  // independent partial sums: the compiler vectorizes them, as MLX's sum does
  float partial[kLanes] = {};
  int i = 0;
  if (step == 1) {
    for (; i + kLanes <= n; i += kLanes)
      for (int l = 0; l < kLanes; ++l) partial[l] += xr[i + l] * xr[i + l];
  }
  float sum = 0;
  for (; i < n; ++i) sum += xr[i * step] * xr[i * step];
  for (float p : partial) sum += p;
  // As MLX's reference: x * rsqrt(mean(x^2) + eps), then times the weight.
  const float scale = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int j = 0; j < n; ++j) {
    const float v = xr[j * step] * scale;
    orow[j] = w ? v * w[j] : v;
  }
}


mx::array rms_norm_cpu(const mx::array& x, const std::optional<mx::array>& weight, float eps) {
  // Other dtypes, and a weight that is not a row-contiguous float32 array already on the host, keep
  // MLX's own formulation.
  if (x.dtype() != mx::float32 || !weight_ready(weight) || x.size() == 0 || x.ndim() == 0) {
    return mx::fast::rms_norm(x, weight, eps);
  }
  std::vector<mx::array> inputs{x};
  if (weight) inputs.push_back(*weight);
  // Each row is read whole (its sum) before it is written, so the output may take x's buffer.
  return host_kernel("RmsNormCpu", x.shape(), mx::float32, std::move(inputs),
                     [eps](const std::vector<mx::array>& in, mx::array& out) { rms_norm_rows(in, out, eps); },
                     /*may_reuse_input0=*/true);
}

std::vector<mx::array> add_rms_norm_cpu(const mx::array& a, const mx::array& b, const std::optional<mx::array>& weight,
                                        float eps) {
  if (a.dtype() != mx::float32 || b.dtype() != mx::float32 || a.shape() != b.shape() || !weight_ready(weight) ||
      a.size() == 0 || a.ndim() == 0 || (weight && weight->shape(0) != a.shape(-1))) {
    return {};
  }
  std::vector<mx::array> inputs{a, b};
  if (weight) inputs.push_back(*weight);
  auto loop = [eps](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
    const mx::array &x = in[0], &y = in[1];
    const size_t size = x.size();
    const int n = x.shape(-1);
    float* sum = out[0].data<float>();
    if (x.flags().row_contiguous && y.flags().row_contiguous) {
      const float *xp = x.data<float>(), *yp = y.data<float>();
      for (size_t i = 0; i < size; ++i) sum[i] = xp[i] + yp[i];  // one float32 add each, as mx::add
    } else {
      for (size_t i = 0; i < size; ++i) sum[i] = element(x, i) + element(y, i);
    }
    const float* w = in.size() > 2 ? in[2].data<float>() : nullptr;
    float* o = out[1].data<float>();
    for (size_t r = 0; r < size / n; ++r) rms_norm_row_f32(sum + r * n, 1, n, w, eps, o + r * n);
  };
  add_norm_nodes.fetch_add(1, std::memory_order_relaxed);
  return host_kernel_multi("AddRmsNormCpu", {a.shape(), a.shape()}, mx::float32, std::move(inputs), loop);
}

}  // namespace etmlx::kernels

extern "C" __attribute__((visibility("default"))) long long etmlx_add_rms_norm_nodes() {
  return etmlx::kernels::add_norm_nodes.load();
}
