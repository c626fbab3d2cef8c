// exec_random_bits: the one random source of the graph (mlx::core::random::bits).
//
// Keys are built on the device from the seed tensor, so a seeded draw never
// waits for the host: key(seed) = (seed >> 32, seed & 0xffffffff) of the seed
// as uint64, which is exactly mlx::core::random::key(seed).
#include <mlx/ops.h>
#include <mlx/random.h>

#include "interpreter.h"
#include "size_limits.h"

namespace etmlx {

namespace mx = mlx::core;

namespace {

// [..., 2] uint32 keys for an integer seed array of any shape.
mx::array keys_from_seeds(const mx::array& seeds) {
  const mx::array s = mx::astype(seeds, mx::uint64);
  const mx::array hi = mx::astype(mx::right_shift(s, mx::array(uint64_t{32}, mx::uint64)), mx::uint32);
  const mx::array lo = mx::astype(mx::bitwise_and(s, mx::array(uint64_t{0xffffffff}, mx::uint64)), mx::uint32);
  return mx::stack({hi, lo}, -1);
}

}  // namespace

bool Interpreter::exec_random_bits(const fb::RandomBitsNode& n) {
  std::vector<int64_t> dims;
  if (!resolve_shape(n.shape(), &dims)) return false;
  mx::Shape shape;
  for (int64_t d : dims) {
    if (d < 0 || d > kMaxDim) return fail("has invalid size %lld", static_cast<long long>(d));
    shape.push_back(static_cast<int32_t>(d));
  }
  const auto numel = checked_numel(dims);
  const int width = n.width();
  if (width != 1 && width != 2 && width != 4) return fail("has unsupported width %d (1, 2 or 4)", width);
  if (!numel || *numel > kMaxArrayBytes / 4) return fail("has a shape that is too large");

  if (n.seed() == nullptr) {  // unseeded: MLX's global key sequence
    return write(n.out(), mx::random::bits(shape, width));
  }
  const mx::array* seed = read(n.seed());
  if (!seed) return false;
  if (!mx::issubdtype(seed->dtype(), mx::integer)) return fail("seed must be an integer tensor");
  if (seed->ndim() == 0) {
    return write(n.out(), mx::random::bits(shape, width, keys_from_seeds(*seed)));
  }
  if (seed->ndim() != 1) return fail("seed must be 0-d or 1-d, got %d dims", static_cast<int>(seed->ndim()));
  const int rows = seed->shape(0);
  if (shape.empty() || shape[0] != rows) {
    return fail("has %d per-row seeds but its shape does not start with %d", rows, rows);
  }
  // One key per row: row i is what a batch-1 draw with seed[i] would give.
  const mx::Shape row_shape(shape.begin() + 1, shape.end());
  const mx::array keys = keys_from_seeds(*seed);
  if (rows == 0) return write(n.out(), mx::random::bits(shape, width, keys_from_seeds(mx::array(0))));
  std::vector<mx::array> drawn;
  drawn.reserve(rows);
  for (int i = 0; i < rows; ++i) {
    drawn.push_back(mx::random::bits(row_shape, width, mx::take(keys, i, 0)));
  }
  return write(n.out(), mx::stack(drawn, 0));
}

}  // namespace etmlx
