// Rotate-half RoPE from tables on the CPU kernel set as one host loop. rope_from_tables composes the
// graph's own ops (two slices, a negation, a concatenation, two products, a sum and the tables'
// broadcasts: ~9 MLX nodes a rotation, ~430 in a 24-layer decode step, each scheduled at a few
// microseconds). This loop computes the same float32 expression, x * cos + rotated * sin, each
// product and the sum rounded once as MLX rounds them (the file is built without floating-point
// contraction, so no fused multiply-add changes a bit).
#include "kernels/rope.h"

#include <atomic>
#include <utility>
#include <vector>

#include "kernels/host_kernel.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

// Element offset in `a` of row `r` of an array of shape `x` (rows: every index but the last axis),
// with `a` broadcast to `x` as numpy aligns shapes (from the right; size-1 axes repeat).
size_t row_offset(const mx::array& a, const mx::Shape& x, size_t r) {
  size_t offset = 0;
  const int xnd = static_cast<int>(x.size()), skip = xnd - static_cast<int>(a.ndim());
  for (int d = xnd - 2; d >= 0; --d) {
    const size_t size = static_cast<size_t>(x[d]);
    const size_t index = r % size;
    r /= size;
    const int ad = d - skip;
    if (ad >= 0 && a.shape(ad) != 1) offset += index * static_cast<size_t>(a.strides()[ad]);
  }
  return offset;
}

void rotate(const mx::array& x, const mx::array& cos, const mx::array& sin, mx::array& out) {
  const mx::Shape& shape = x.shape();
  const int dims = shape.back(), half = dims / 2;
  const size_t rows = x.size() / static_cast<size_t>(dims);
  const size_t xs = x.strides().back(), cs = cos.strides().back(), ss = sin.strides().back();
  float* o = out.data<float>();
  for (size_t r = 0; r < rows; ++r) {
    const float* xr = x.data<float>() + row_offset(x, shape, r);
    const float* cr = cos.data<float>() + row_offset(cos, shape, r);
    const float* sr = sin.data<float>() + row_offset(sin, shape, r);
    float* orow = o + r * dims;
    for (int j = 0; j < half; ++j) orow[j] = xr[j * xs] * cr[j * cs] + (-xr[(j + half) * xs]) * sr[j * ss];
    for (int j = half; j < dims; ++j) orow[j] = xr[j * xs] * cr[j * cs] + xr[(j - half) * xs] * sr[j * ss];
  }
}

void rope_rows(const std::vector<mx::array>& in, mx::array& out) { rotate(in[0], in[1], in[2], out); }

std::atomic<long long> pair_nodes{0};

}  // namespace

std::vector<mx::array> rope_tables_pair_cpu(const mx::array& q, const mx::array& k, const mx::array& cos,
                                            const mx::array& sin) {
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || q.size() == 0 || k.size() == 0) return {};
  pair_nodes.fetch_add(1, std::memory_order_relaxed);
  return host_kernel_multi("RopePairCpu", {q.shape(), k.shape()}, mx::float32, {q, k, cos, sin},
                           [](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
                             rotate(in[0], in[2], in[3], out[0]);
                             rotate(in[1], in[2], in[3], out[1]);
                           });
}

long long rope_pair_nodes() { return pair_nodes.load(); }

mx::array rope_tables_cpu(const mx::array& x, const mx::array& cos, const mx::array& sin) {
  if (x.dtype() != mx::float32 || x.size() == 0) return rope_from_tables(x, cos, sin);
  return host_kernel("RopeCpu", x.shape(), mx::float32, {x, cos, sin}, rope_rows);
}

}  // namespace etmlx::kernels

extern "C" __attribute__((visibility("default"))) long long etmlx_rope_pair_nodes() {
  return etmlx::kernels::rope_pair_nodes();
}
