#include "kernels/random_bits.h"

#include <vector>

#include <mlx/ops.h>
#include <mlx/random.h>

namespace etmlx::kernels {

namespace mx = mlx::core;

mx::array keys_from_seeds(const mx::array& seeds) {
  const mx::array s = mx::astype(seeds, mx::uint64);
  const mx::array hi = mx::astype(mx::right_shift(s, mx::array(uint64_t{32}, mx::uint64)), mx::uint32);
  const mx::array lo = mx::astype(mx::bitwise_and(s, mx::array(uint64_t{0xffffffff}, mx::uint64)), mx::uint32);
  return mx::stack({hi, lo}, -1);
}

std::optional<mx::array> random_bits(const mx::Shape& shape, int width, const std::optional<mx::array>& seed) {
  if (!seed) return mx::random::bits(shape, width);
  if (seed->ndim() == 0) return mx::random::bits(shape, width, keys_from_seeds(*seed));
  const int rows = seed->shape(0);
  if (shape.empty() || shape[0] != rows) return std::nullopt;
  // One key per row: row i is what a batch-1 draw with seed[i] would give.
  const mx::Shape row_shape(shape.begin() + 1, shape.end());
  if (rows == 0) return mx::zeros(shape, width == 4 ? mx::uint32 : width == 2 ? mx::uint16 : mx::uint8);
  const mx::array keys = keys_from_seeds(*seed);
  std::vector<mx::array> drawn;
  drawn.reserve(rows);
  for (int i = 0; i < rows; ++i) drawn.push_back(mx::random::bits(row_shape, width, mx::take(keys, i, 0)));
  return mx::stack(drawn, 0);
}

}  // namespace etmlx::kernels
