// The MoE expert nodes (GatherMmNode, GatherQmmNode): each (token, k) pair multiplies its row by its
// own expert's matrix through mlx::core::gather_mm / gather_qmm, which index the expert stack
// instead of materializing a [T, K, out, in] gather of it.
#include <mlx/ops.h>

#include "dtypes.h"
#include "interpreter.h"

namespace etmlx {

namespace mx = mlx::core;

namespace {

// x [T, in] or [T, K, in] as gather_mm's `a`: batch dims that broadcast against indices [T, K], one row
// each (mlx-lm's SwitchLinear shapes it the same way).
mx::array as_rows(const mx::array& x) {
  return x.ndim() == 2 ? mx::reshape(x, {x.shape(0), 1, 1, x.shape(1)}) : mx::expand_dims(x, -2);
}

}  // namespace

// Operands shared by both nodes: x's rank and sizes against indices [T, K] and the weights' `in`.
bool Interpreter::read_expert_operands(const fb::Tid* x_tid, const fb::Tid* indices_tid, int experts,
                                       int in_features, const mx::array** x, mx::array* indices) {
  *x = read(x_tid);
  if (!*x) return false;
  const mx::array* idx = read(indices_tid);
  if (!idx) return false;
  if (idx->ndim() != 2) return fail("indices must be 2-d [tokens, k], got %d-d", static_cast<int>(idx->ndim()));
  const mx::array& a = **x;
  if (a.ndim() != 2 && a.ndim() != 3) return fail("x must be [tokens, in] or [tokens, k, in], got %d-d",
                                                  static_cast<int>(a.ndim()));
  if (a.shape(0) != idx->shape(0) || (a.ndim() == 3 && a.shape(1) != idx->shape(1))) {
    return fail("x's leading sizes do not match indices [%d, %d]", idx->shape(0), idx->shape(1));
  }
  if (a.shape(-1) != in_features) return fail("x's last size %d is not the experts' %d input features",
                                              a.shape(-1), in_features);
  if (!mx::issubdtype(a.dtype(), mx::floating)) return fail("x must be floating, got %s",
                                                           mlx_dtype_name(a.dtype()));
  return safe_indices(*idx, experts, "indices", indices);
}

bool Interpreter::exec_gather_mm(const fb::GatherMmNode& n) {
  const mx::array* pw = read(n.w());
  if (!pw) return false;
  if (pw->ndim() != 3) return fail("expert weights must be 3-d [experts, ., .], got %d-d",
                                   static_cast<int>(pw->ndim()));
  // gather_mm's b is [E, in, out]: the transposed layout as it is, else a strided view of [E, out, in]
  // (MLX's kernels read either order without a copy).
  mx::array w = n.transposed() ? *pw : mx::swapaxes(*pw, -1, -2);
  const mx::array* x = nullptr;
  mx::array indices = mx::array(0);
  if (!read_expert_operands(n.x(), n.indices(), w.shape(0), w.shape(1), &x, &indices)) return false;
  if (x->dtype() != w.dtype()) {
    return fail("x is %s but the expert weights are %s", mlx_dtype_name(x->dtype()), mlx_dtype_name(w.dtype()));
  }
  const mx::Dtype dtype = x->dtype();
  mx::array a = as_rows(*x);
  if (dtype != mx::float32 && mx::default_device() == mx::Device::cpu) {
    // MLX's CPU gather_mm multiplies float32 only. Widen whichever is smaller: the T * K matrices the
    // pairs use (gathered first: a decode step touches a few experts) or the whole stack of E.
    a = mx::astype(a, mx::float32);
    if (static_cast<int64_t>(indices.size()) < w.shape(0)) {
      mx::array used = mx::astype(mx::take(w, mx::flatten(indices), 0), mx::float32);
      mx::array pair = mx::reshape(mx::arange(static_cast<int>(indices.size()), mx::uint32), indices.shape());
      mx::array out = mx::gather_mm(a, used, std::nullopt, pair);
      return write(n.out(), mx::astype(mx::squeeze(out, -2), dtype));
    }
    w = mx::astype(w, mx::float32);
  }
  mx::array out = mx::gather_mm(a, w, std::nullopt, indices);  // [T, K, 1, out]
  return write(n.out(), mx::astype(mx::squeeze(out, -2), dtype));
}

bool Interpreter::exec_gather_qmm(const fb::GatherQmmNode& n) {
  const mx::array *w = nullptr, *scales = nullptr, *biases = nullptr;
  int in_features = 0;
  if (!read_quantized_weights(n.w(), n.scales(), n.biases(), n.group_size(), n.bits(), &w, &scales, &biases,
                              &in_features, /*ndim=*/3)) {
    return false;
  }
  const mx::array* x = nullptr;
  mx::array indices = mx::array(0);
  if (!read_expert_operands(n.x(), n.indices(), w->shape(0), in_features, &x, &indices)) return false;
  if (x->dtype() != scales->dtype()) {
    return fail("x is %s but the scales are %s", mlx_dtype_name(x->dtype()), mlx_dtype_name(scales->dtype()));
  }
  mx::array out = mx::gather_qmm(as_rows(*x), *w, *scales, *biases, std::nullopt, indices, /*transpose=*/true,
                                 n.group_size(), n.bits(), "affine");
  return write(n.out(), mx::squeeze(out, -2));
}

}  // namespace etmlx
