// The spatial nodes (ConvNode, PadNode): mlx::core::conv_general and mlx::core::pad, every
// list from the blob checked against the operands first (mlx would throw or misbehave on a
// negative padding or a group count that does not divide the channels).
#include <cmath>
#include <vector>

#include <mlx/ops.h>

#include "dtypes.h"
#include "interpreter.h"
#include "size_limits.h"

namespace etmlx {

namespace mx = mlx::core;

namespace {

// A list field of `count` ints, each at least `min` (and below kMaxDim), into `out`.
bool int_list(const flatbuffers::Vector<int32_t>* v, size_t count, int min, std::vector<int>* out) {
  if (v == nullptr || v->size() != count) return false;
  out->clear();
  for (flatbuffers::uoffset_t i = 0; i < v->size(); ++i) {
    const int x = v->Get(i);
    if (x < min || x > kMaxDim) return false;
    out->push_back(x);
  }
  return true;
}

}  // namespace

bool Interpreter::exec_conv(const fb::ConvNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  const mx::array* w = read(n.w());
  if (!w) return false;
  const int rank = static_cast<int>(x->ndim());
  if (rank < 3 || rank > 5) return fail("input has rank %d (1 to 3 spatial axes expected)", rank);
  if (static_cast<int>(w->ndim()) != rank) return fail("weight rank %zu differs from input rank %d", w->ndim(), rank);
  if (!mx::issubdtype(x->dtype(), mx::floating) || w->dtype() != x->dtype()) {
    return fail("needs floating input and weight of one dtype, got %s and %s", mlx_dtype_name(x->dtype()),
                mlx_dtype_name(w->dtype()));
  }
  const size_t spatial = static_cast<size_t>(rank - 2);
  std::vector<int> stride, lo, hi, kdil, idil;
  if (!int_list(n.stride(), spatial, 1, &stride)) return fail("has an invalid stride list");
  if (!int_list(n.padding_lo(), spatial, 0, &lo)) return fail("has an invalid padding_lo list");
  if (!int_list(n.padding_hi(), spatial, 0, &hi)) return fail("has an invalid padding_hi list");
  if (!int_list(n.kernel_dilation(), spatial, 1, &kdil)) return fail("has an invalid kernel_dilation list");
  if (!int_list(n.input_dilation(), spatial, 1, &idil)) return fail("has an invalid input_dilation list");
  const int groups = n.groups();
  const int c_in = x->shape(-1), c_out = w->shape(0);
  if (groups < 1 || c_in % groups != 0 || c_out % groups != 0 || w->shape(-1) * groups != c_in) {
    return fail("has groups=%d for %d input channels, %d output channels and a weight of %d input channels",
                groups, c_in, c_out, w->shape(-1));
  }
  for (size_t i = 0; i < spatial; ++i) {
    const int64_t in = (static_cast<int64_t>(x->shape(1 + i)) - 1) * idil[i] + 1 + lo[i] + hi[i];
    const int64_t k = (static_cast<int64_t>(w->shape(1 + i)) - 1) * kdil[i] + 1;
    if (x->shape(1 + i) < 1 || in < k) return fail("spatial axis %zu is smaller than the kernel", i);
  }
  return write(n.out(), mx::conv_general(*x, *w, stride, lo, hi, kdil, idil, groups, n.flip()));
}

bool Interpreter::exec_pad(const fb::PadNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  const int ndim = static_cast<int>(x->ndim());
  if (n.axes() == nullptr) return fail("is missing its axes");
  const size_t count = n.axes()->size();
  std::vector<int> axes, low, high;
  if (!int_list(n.low(), count, 0, &low) || !int_list(n.high(), count, 0, &high)) {
    return fail("has pad widths that are negative, too large, or not one per axis");
  }
  mx::Shape lo, hi;
  for (size_t i = 0; i < count; ++i) {
    int a = 0;
    if (!norm_axis(n.axes()->Get(i), ndim, &a, "axis")) return false;
    for (int seen : axes) {
      if (seen == a) return fail("names axis %d twice", a);
    }
    if (static_cast<int64_t>(x->shape(a)) + low[i] + high[i] > kMaxDim) return fail("pads axis %d too far", a);
    axes.push_back(a);
    lo.push_back(low[i]);
    hi.push_back(high[i]);
  }
  const double v = n.value();
  mx::array value(0.0f);
  if (x->dtype() == mx::bool_) {
    value = mx::array(v != 0.0);
  } else if (mx::issubdtype(x->dtype(), mx::integer)) {
    if (!(v >= -9223372036854775808.0 && v < 9223372036854775808.0) || std::floor(v) != v) {
      return fail("pad value %g does not fit an integer tensor", v);
    }
    value = mx::astype(mx::array(static_cast<int64_t>(v), mx::int64), x->dtype());
  } else {
    value = mx::astype(mx::array(static_cast<float>(v)), x->dtype());
  }
  return write(n.out(), mx::pad(*x, axes, lo, hi, value));
}

}  // namespace etmlx
