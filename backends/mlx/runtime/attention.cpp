// exec_sdpa: attention through MLX's fused kernel (semantics in schema.fbs).
#include <cstdlib>
#include <cstring>
#include <limits>

#include <mlx/fast.h>
#include <mlx/transforms.h>
#include <mlx/ops.h>

#include "interpreter.h"

namespace etmlx {

namespace mx = mlx::core;

namespace {

// ETMLX_KEY_WINDOW=0 attends over every key even when the exporter proved a
// window (for A/B measurements; results are the same either way).
bool key_window_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("ETMLX_KEY_WINDOW");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

bool integer_vector(const mx::array& values) {
  return values.ndim() == 1 && values.size() > 0 && mx::issubdtype(values.dtype(), mx::integer);
}

// max(values) of a small 1-d integer tensor (the rows' start positions); the
// runtime reads it on the host, which for a program input costs nothing.
int64_t max_of(const mx::array& values) {
  mx::array v = mx::astype(values, mx::int64);
  mx::eval(v);
  const int64_t* data = v.data<int64_t>();
  int64_t m = std::numeric_limits<int64_t>::min();
  for (size_t i = 0; i < v.size(); ++i) m = std::max(m, data[i]);
  return m;
}

}  // namespace

// Keys [0, end) when the node's proven window leaves fewer than S of them, else S.
bool Interpreter::sdpa_window_end(const fb::SdpaNode& n, int batch, int query_len, int keys, int* end) {
  *end = keys;
  // (A causal node has L == S by definition; a window is only ever proven from a mask.)
  if (!n.window() || n.causal() || !key_window_enabled()) return true;
  const mx::array* base = nullptr;
  if (n.window_base() != nullptr) {
    base = read(n.window_base());
    if (!base) return false;
    if (!integer_vector(*base)) return fail("window_base must be a non-empty 1-d integer tensor");
  }
  // One row only: with several, the window is the widest row's, and the number of
  // keys a row's products sum over (hence their rounding) would depend on which
  // other requests share the call. A served request must get the same bits
  // whatever it is batched with, so multi-row calls attend over every key.
  if (batch != 1) return true;
  int64_t e = base ? max_of(*base) : 0;
  const int64_t extra = n.window_per_query() ? query_len : 1;
  if (__builtin_add_overflow(e, n.window_shift(), &e) || __builtin_add_overflow(e, extra, &e)) return true;
  if (e >= 1 && e < keys) *end = static_cast<int>(e);
  return true;
}

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
  const int keys = k->shape(2);
  int end = keys;
  if (!sdpa_window_end(n, q->shape(0), q->shape(2), keys, &end)) return false;
  mx::array kk = *k, vv = *v;
  if (end < keys) {
    auto first = [end](const mx::array& x, int axis) {
      mx::Shape start(x.ndim(), 0), stop = x.shape();
      stop[axis] = end;
      return mx::slice(x, start, stop);
    };
    kk = first(kk, 2);
    vv = first(vv, 2);
    if (mask && mask->ndim() >= 1 && mask->shape(-1) == keys) mask = first(*mask, mask->ndim() - 1);
  }
  const std::string mode = mask ? "array" : (n.causal() ? "causal" : "");
  return write(n.out(), mx::fast::scaled_dot_product_attention(*q, kk, vv, n.scale(), mode, mask));
}

}  // namespace etmlx
