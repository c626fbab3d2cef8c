// exec_rope: rotate-half rotary embedding (semantics in schema.fbs).
//
// From cos and sin the node composes the ops the exported graph had, so it is
// bit-identical to it. When the exporter proved the
// tables are cos/sin((offset[b] + l) * inv_freq) it also passes offset and
// freqs, and devices with a fused kernel (Metal, CUDA) run
// mlx::core::fast::rope instead: one pass over x, no tables read. On the CPU
// device fast::rope is itself a composition that recomputes the tables for
// every call, so there the shared tables are cheaper (measured on x [1, 8, 64, 64]
// float32: 0.80 ms for fast::rope against 0.47 ms from the tables).
#include <cstdlib>

#include <mlx/fast.h>
#include <mlx/ops.h>

#include "dtypes.h"
#include "interpreter.h"

namespace etmlx {

namespace mx = mlx::core;

namespace {

// True when `t` broadcasts to `x` without changing x's shape.
bool broadcasts_to(const mx::array& t, const mx::array& x) {
  if (t.ndim() > x.ndim()) return false;
  const int lead = static_cast<int>(x.ndim() - t.ndim());
  for (int i = 0; i < static_cast<int>(t.ndim()); ++i) {
    if (t.shape(i) != 1 && t.shape(i) != x.shape(lead + i)) return false;
  }
  return true;
}

// Whether to use mx::fast::rope where the exporter allowed it. ETMLX_FAST_ROPE=1 or 0
// overrides the device's choice (tests run the kernel path on the CPU with it).
bool use_fast_rope() {
  const char* env = std::getenv("ETMLX_FAST_ROPE");
  if (env != nullptr && env[0] == '1') return true;
  if (env != nullptr && env[0] == '0') return false;
  return mx::default_device() != mx::Device::cpu;
}

mx::array last_axis(const mx::array& a, int start, int stop) {
  mx::Shape lo(a.ndim(), 0), hi = a.shape();
  lo.back() = start;
  hi.back() = stop;
  return mx::slice(a, lo, hi);
}

}  // namespace

bool Interpreter::exec_rope(const fb::RopeNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  const mx::array* cos = read(n.cos());
  if (!cos) return false;
  const mx::array* sin = read(n.sin());
  if (!sin) return false;
  if (!mx::issubdtype(x->dtype(), mx::floating)) {
    return fail("needs a floating x, got %s", mlx_dtype_name(x->dtype()));
  }
  if (x->ndim() == 0 || x->shape(-1) % 2 != 0 || x->shape(-1) == 0) {
    return fail("needs x whose last size is even and positive");
  }
  const int dims = x->shape(-1), half = dims / 2;
  for (const mx::array* t : {cos, sin}) {
    if (t->dtype() != x->dtype()) {
      return fail("needs cos and sin in x's dtype %s, got %s", mlx_dtype_name(x->dtype()),
                  mlx_dtype_name(t->dtype()));
    }
    if (t->ndim() == 0 || t->shape(-1) != dims || !broadcasts_to(*t, *x)) {
      return fail("needs cos and sin broadcastable to x with last size %d", dims);
    }
  }
  if ((n.offset() == nullptr) != (n.freqs() == nullptr)) return fail("needs both offset and freqs, or neither");
  if (n.offset() != nullptr) {
    const mx::array* offset = read(n.offset());
    if (!offset) return false;
    const mx::array* freqs = read(n.freqs());
    if (!freqs) return false;
    if (x->ndim() != 4) return fail("with offset needs x [B, H, L, D]");
    if (!mx::issubdtype(offset->dtype(), mx::integer) || offset->ndim() > 1 ||
        (offset->ndim() == 1 && offset->size() != 1 && offset->shape(0) != x->shape(0))) {
      return fail("needs an integer offset, 0-d or one per batch row");
    }
    if (freqs->dtype() != mx::float32 || freqs->ndim() != 1 || freqs->shape(0) != half) {
      return fail("needs float32 freqs of %d elements", half);
    }
    if (use_fast_rope()) {
      return write(n.out(), mx::fast::rope(*x, dims, /*traditional=*/false, std::nullopt, 1.0f, *offset, *freqs));
    }
  }
  // The graph's own ops (the negation is exact), which on the CPU device also beat a
  // half-by-half form that reads strided halves of the tables.
  const mx::array rotated = mx::concatenate({mx::negative(last_axis(*x, half, dims)), last_axis(*x, 0, half)}, -1);
  return write(n.out(), mx::add(mx::multiply(*x, *cos), mx::multiply(rotated, *sin)));
}

}  // namespace etmlx
