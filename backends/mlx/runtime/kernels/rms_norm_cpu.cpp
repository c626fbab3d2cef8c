// RMSNorm on the CPU kernel set as one host loop. MLX has no CPU kernel for mx::fast::rms_norm: on
// the CPU it expands into its reference ops (square, sum, multiply, add, rsqrt, multiply, multiply
// and their broadcasts), about nine graph nodes per norm, ~440 in a 24-layer decode step, each
// scheduled at a few microseconds. One node computes the same float32 formula.
#include "kernels/norms.h"

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
  constexpr int kLanes = 16;  // independent partial sums: the compiler vectorizes them, as MLX's sum does
  for (size_t r = 0; r < rows; ++r) {
    const float* xr = base + (x.flags().row_contiguous ? r * n : row_offset(x, r));
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
    float* orow = o + r * n;
    for (int j = 0; j < n; ++j) {
      const float v = xr[j * step] * scale;
      orow[j] = w ? v * w[j] : v;
    }
  }
}

}  // namespace

mx::array rms_norm_cpu(const mx::array& x, const std::optional<mx::array>& weight, float eps) {
  // Other dtypes, and a weight that is not a row-contiguous float32 array already on the host, keep
  // MLX's own formulation.
  const bool weight_ready = !weight || (weight->dtype() == mx::float32 && weight->ndim() == 1 &&
                                        weight->status() == mx::array::Status::available &&
                                        weight->flags().row_contiguous);
  if (x.dtype() != mx::float32 || !weight_ready || x.size() == 0 || x.ndim() == 0) {
    return mx::fast::rms_norm(x, weight, eps);
  }
  std::vector<mx::array> inputs{x};
  if (weight) inputs.push_back(*weight);
  // Each row is read whole (its sum) before it is written, so the output may take x's buffer.
  return host_kernel("RmsNormCpu", x.shape(), mx::float32, std::move(inputs),
                     [eps](const std::vector<mx::array>& in, mx::array& out) { rms_norm_rows(in, out, eps); },
                     /*may_reuse_input0=*/true);
}

}  // namespace etmlx::kernels
