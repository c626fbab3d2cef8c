// exec_sdpa: attention through MLX's fused kernel (semantics in schema.fbs).
#include <mlx/fast.h>
#include <mlx/ops.h>

#include "interpreter.h"

namespace etmlx {

namespace mx = mlx::core;

bool Interpreter::exec_sdpa(const fb::SdpaNode& n) {
  const mx::array* q = read(n.q());
  if (!q) return false;
  const mx::array* k = read(n.k());
  if (!k) return false;
  const mx::array* v = read(n.v());
  if (!v) return false;
  if (q->ndim() != 4 || k->ndim() != 4 || v->ndim() != 4) return fail("q, k and v must be 4-d");
  if (!mx::issubdtype(q->dtype(), mx::floating) || k->dtype() != q->dtype() || v->dtype() != q->dtype()) {
    return fail("q, k and v must share one floating dtype");
  }
  const int heads = q->shape(1), kv_heads = k->shape(1);
  if (kv_heads == 0 || heads % kv_heads != 0 || v->shape(1) != kv_heads) {
    return fail("has %d query heads for %d key/value heads", heads, kv_heads);
  }
  if (k->shape(3) != q->shape(3) || k->shape(2) != v->shape(2) || k->shape(0) != q->shape(0) ||
      v->shape(0) != q->shape(0)) {
    return fail("q, k and v shapes do not fit together");
  }
  std::optional<mx::array> mask;
  if (n.mask() != nullptr) {
    const mx::array* m = read(n.mask());
    if (!m) return false;
    if (m->ndim() > 4) return fail("mask has %d dims (at most 4)", static_cast<int>(m->ndim()));
    // Additive masks must be in the query dtype; boolean ones stay boolean.
    mask = m->dtype() == mx::bool_ ? *m : mx::astype(*m, q->dtype());
  }
  if (n.causal() && q->shape(2) != k->shape(2)) return fail("causal attention needs L == S");
  const std::string mode = mask ? "array" : (n.causal() ? "causal" : "");
  return write(n.out(), mx::fast::scaled_dot_product_attention(*q, *k, *v, n.scale(), mode, mask));
}

}  // namespace etmlx
