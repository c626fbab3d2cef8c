#include "kernels/rope.h"

#include <cstdlib>

#include <mlx/fast.h>
#include <mlx/ops.h>

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

mx::array last_axis(const mx::array& a, int start, int stop) {
  mx::Shape lo(a.ndim(), 0), hi = a.shape();
  lo.back() = start;
  hi.back() = stop;
  return mx::slice(a, lo, hi);
}

}  // namespace

mx::array rope_from_tables(const mx::array& x, const mx::array& cos, const mx::array& sin) {
  const int dims = x.shape(-1), half = dims / 2;
  // The graph's own ops (the negation is exact), which on the CPU device also beat a
  // half-by-half form that reads strided halves of the tables.
  const mx::array rotated = mx::concatenate({mx::negative(last_axis(x, half, dims)), last_axis(x, 0, half)}, -1);
  return mx::add(mx::multiply(x, cos), mx::multiply(rotated, sin));
}

mx::array rope_fast(const mx::array& x, const mx::array& offset, const mx::array& freqs) {
  return mx::fast::rope(x, x.shape(-1), /*traditional=*/false, std::nullopt, 1.0f, offset, freqs);
}

bool use_fast_rope(bool preferred, options::Forced forced) {
  return forced == options::Forced::unset ? preferred : forced == options::Forced::on;
}

}  // namespace etmlx::kernels
