// allowed_mask_device: the bits unpacked with mlx ops ([B, W, 32] AND, compare, slice), then a select.
#include <limits>
#include <vector>

#include <mlx/ops.h>

#include "kernels/allowed_mask.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

mx::array allowed_mask_device(const mx::array& x, const mx::array& mask) {
  const int rows = x.shape(0), vocab = x.shape(1), words = mask.shape(1);
  std::vector<int32_t> bits(32);
  for (int j = 0; j < 32; ++j) bits[j] = static_cast<int32_t>(static_cast<uint32_t>(1) << j);
  const mx::array bit = mx::array(bits.begin(), {32}, mx::int32);
  const mx::array set = mx::not_equal(mx::bitwise_and(mx::expand_dims(mask, -1), bit), mx::array(0, mx::int32));
  const mx::array allowed = mx::slice(mx::reshape(set, {rows, words * 32}), {0, 0}, {rows, vocab});
  return mx::where(allowed, x, mx::array(-std::numeric_limits<float>::infinity(), mx::float32));
}

mx::array drawn_or_none_device(const mx::array& tokens, const mx::array& x) {
  // Out-of-range ids cannot come from the sampler; a hand-made blob's answer -1 (as on the cpu),
  // read through clamped ids so they never index past x.
  const mx::array ids = mx::astype(tokens, mx::int64);
  const mx::array safe = mx::clip(ids, mx::array(static_cast<int64_t>(0)), mx::array(static_cast<int64_t>(x.shape(1) - 1)));
  const mx::array drawn = mx::squeeze(mx::take_along_axis(x, mx::expand_dims(safe, 1), 1), 1);
  const mx::array ok = mx::logical_and(mx::equal(ids, safe),
                                       mx::greater(drawn, mx::array(-std::numeric_limits<float>::infinity(), mx::float32)));
  return mx::where(ok, ids, mx::array(static_cast<int64_t>(-1), mx::int64));
}

}  // namespace etmlx::kernels
