#include "kernels/silu_product.h"

#include <string_view>
#include <vector>

#include <mlx/compile.h>
#include <mlx/ops.h>
#include <mlx/primitives.h>

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

bool is_op(const mx::array& x, std::string_view name) {
  return x.has_primitive() && std::string_view(x.primitive().name()) == name;
}

// g when p is sigmoid(g) * g or g * sigmoid(g), else null.
const mx::array* silu_gate(const mx::array& p) {
  if (!is_op(p, "Multiply") || p.inputs().size() != 2) return nullptr;
  for (int i = 0; i < 2; ++i) {
    const mx::array& s = p.inputs()[i];
    const mx::array& g = p.inputs()[1 - i];
    if (is_op(s, "Sigmoid") && s.inputs().size() == 1 && s.inputs()[0].id() == g.id()) return &g;
  }
  return nullptr;
}

std::vector<mx::array> silu_times(const std::vector<mx::array>& in) {
  return {mx::multiply(mx::multiply(mx::sigmoid(in[0]), in[0]), in[1])};
}

}  // namespace

std::optional<mx::array> silu_product_device(const mx::array& a, const mx::array& b) {
  for (int i = 0; i < 2; ++i) {
    const mx::array& p = i == 0 ? a : b;
    const mx::array& u = i == 0 ? b : a;
    const mx::array* g = silu_gate(p);
    // p = sigmoid(g) * g has g's shape and dtype: u is checked against g alone.
    if (g == nullptr || !mx::issubdtype(u.dtype(), mx::floating) || g->dtype() != u.dtype() ||
        g->shape() != u.shape()) {
      continue;
    }
    // Shapeless: one compiled kernel for prefill and decode shapes alike.
    static const auto compiled = mx::compile(silu_times, /*shapeless=*/true);
    return compiled({*g, u})[0];
  }
  return std::nullopt;
}

}  // namespace etmlx::kernels
