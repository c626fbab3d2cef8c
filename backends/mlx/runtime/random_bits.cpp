// exec_random_bits: the one random source of the graph (mlx::core::random::bits).
//
// Keys are built on the device from the seed tensor, so a seeded draw never
// waits for the host: key(seed) = (seed >> 32, seed & 0xffffffff) of the seed
// as uint64, which is exactly mlx::core::random::key(seed).
#include <mlx/ops.h>
#include <mlx/random.h>

#include "interpreter.h"
#include "random_keys.h"
#include "size_limits.h"

namespace etmlx {

namespace mx = mlx::core;

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

  const mx::array* seed = nullptr;
  if (n.seed() != nullptr) {
    seed = read(n.seed());
    if (!seed) return false;
    if (!mx::issubdtype(seed->dtype(), mx::integer)) return fail("seed must be an integer tensor");
    if (seed->ndim() > 1) return fail("seed must be 0-d or 1-d, got %d dims", static_cast<int>(seed->ndim()));
  }
  auto bits = draw_bits(shape, width, seed);
  if (!bits) return fail("has %d per-row seeds but its shape does not start with %d", seed->shape(0), seed->shape(0));
  return write(n.out(), *bits);
}

}  // namespace etmlx
