#include "interpreter.h"
#include "host_fold.h"
#include "lazy_check.h"
#include "size_limits.h"
#include "kernels/attention_cpu.h"
#include "kernels/kernel_set.h"
#include "kernels/known_values.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <string>
#include <cstdio>
#include <limits>

#include <executorch/runtime/platform/log.h>
#include <mlx/primitives.h>
#include <mlx/ops.h>

namespace etmlx {

namespace mx = mlx::core;

Interpreter::Interpreter(const Program& program)
    : program_(program),
      tensors_(program.num_tensors),
      values_(program.num_values),
      keep_written_(program.options.check_lazy),
      fold_on_(program.host_fold) {}

bool Interpreter::fail(const char* fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  ET_LOG(Error, "etmlx: instruction %zu (%s) %s", pc_, node_name_, msg);
  return false;
}

bool Interpreter::run() {
  const auto* instrs = program_.graph->instructions();
  if (instrs == nullptr) return true;
  for (flatbuffers::uoffset_t i = 0; i < instrs->size(); ++i) {
    const fb::Instruction* instr = instrs->Get(i);
    pc_ = i;
    node_name_ = instr ? fb::EnumNameNode(instr->node_type()) : "";
    if (node_name_ == nullptr || node_name_[0] == '\0') node_name_ = "?";
    if (instr == nullptr || instr->node() == nullptr) return fail("has no node");
    if (!run_node(*instr)) return false;
  }
  fold_.clear();  // its references must not outlive the build: they would keep the old state's buffers
  return true;
}

bool Interpreter::run_node(const fb::Instruction& instr) {
#include "node_dispatch.inc"
}

bool Interpreter::unknown_node(int type) {
  return fail("has unknown node type %d (blob from a newer etmlx?)", type);
}

// ---------------------------------------------------------------------------
// Slots

const mx::array* Interpreter::read(const fb::Tid* t) {
  if (t == nullptr) {
    fail("is missing a tensor operand");
    return nullptr;
  }
  const uint32_t idx = t->idx();
  if (idx >= tensors_.size()) {
    fail("names tensor slot %u but the graph has %zu", idx, tensors_.size());
    return nullptr;
  }
  if (!tensors_[idx].has_value()) {
    fail("reads tensor slot %u before it is written", idx);
    return nullptr;
  }
  return &*tensors_[idx];
}

bool Interpreter::write(const fb::Tid* t, mx::array a) {
  if (t == nullptr) return fail("is missing its output");
  const uint32_t idx = t->idx();
  if (idx >= tensors_.size()) {
    return fail("writes tensor slot %u but the graph has %zu", idx, tensors_.size());
  }
  // Recomputed from the shape with overflow checks (a.size() could have
  // wrapped for an absurd shape).
  const auto numel = checked_numel(a.shape());
  if (!numel) return fail("produces a result of absurd size");
  const uint64_t nbytes = *numel * a.itemsize();
  if (nbytes > max_array_bytes()) {  // arrays are lazy: refused here, before anything allocates it
    return fail("produces a %llu-byte result, more than the %llu bytes one array may use (physical "
                "memory; ETMLX_MAX_ARRAY_BYTES sets it)",
                static_cast<unsigned long long>(nbytes),
                static_cast<unsigned long long>(max_array_bytes()));
  }
  // Small arithmetic on what the host already holds becomes a constant here (host_fold.h).
  bool folded_here = false;
  if (fold_on_) {
    if (auto folded = fold_.fold(a)) {
      a = std::move(*folded);
      folded_here = true;
    }
  }
  // A folded array is the host's constant, made without evaluating anything: not a premature evaluation,
  // nor is an op that passes it through unchanged (the lazy check seeds its id, as an input's).
  if (keep_written_ && folded_here) host_made_.push_back(a);
  if (keep_written_) written_.push_back(a);
  tensors_[idx] = std::move(a);
  return true;
}

bool Interpreter::read_value(int64_t idx, int64_t* out) {
  if (idx < 0 || static_cast<uint64_t>(idx) >= values_.size()) {
    return fail("names value slot %lld but the graph has %zu", static_cast<long long>(idx),
                values_.size());
  }
  if (!values_[idx].has_value()) {
    return fail("reads value slot %lld before it is written", static_cast<long long>(idx));
  }
  *out = *values_[idx];
  return true;
}

bool Interpreter::write_value(const fb::Vid* v, int64_t x) {
  if (v == nullptr) return fail("is missing its output");
  if (v->idx() >= values_.size()) {
    return fail("writes value slot %u but the graph has %zu", v->idx(), values_.size());
  }
  values_[v->idx()] = x;
  return true;
}

bool Interpreter::resolve(const fb::IntOrVid* iv, int64_t* out) {
  if (iv == nullptr) return fail("is missing an int operand");
  if (iv->vid() >= 0) return read_value(iv->vid(), out);
  *out = iv->literal();
  return true;
}

bool Interpreter::resolve_shape(
    const flatbuffers::Vector<flatbuffers::Offset<fb::IntOrVid>>* v, std::vector<int64_t>* out) {
  if (v == nullptr) return fail("is missing its shape");
  if (v->size() > static_cast<flatbuffers::uoffset_t>(kMaxRank)) {
    return fail("has a shape of rank %u (max %d)", v->size(), kMaxRank);
  }
  out->clear();
  for (flatbuffers::uoffset_t i = 0; i < v->size(); ++i) {
    int64_t x = 0;
    if (!resolve(v->Get(i), &x)) return false;
    out->push_back(x);
  }
  return true;
}

bool Interpreter::resolve_new_shape(const flatbuffers::Vector<flatbuffers::Offset<fb::IntOrVid>>* v,
                                    mx::Shape* shape) {
  std::vector<int64_t> dims;
  if (!resolve_shape(v, &dims)) return false;
  shape->clear();
  for (int64_t d : dims) {
    if (d < 0 || d > kMaxDim) return fail("has invalid size %lld", static_cast<long long>(d));
    shape->push_back(static_cast<int32_t>(d));
  }
  if (!checked_numel(dims)) return fail("has a shape that is too large");
  return true;
}

bool Interpreter::norm_axis(int64_t axis, int ndim, int* out, const char* what) {
  if (ndim <= 0) return fail("%s %lld given for a 0-d tensor", what, static_cast<long long>(axis));
  int64_t a = axis < 0 ? axis + ndim : axis;
  if (a < 0 || a >= ndim) {
    return fail("%s %lld is out of range for a %d-d tensor", what, static_cast<long long>(axis),
                ndim);
  }
  *out = static_cast<int>(a);
  return true;
}

bool Interpreter::axis_operand(const mx::array& x, int64_t axis, mx::array* x1, int* ax,
                               bool* scalar) {
  if (x.ndim() == 0 && (axis == 0 || axis == -1)) {
    *x1 = mx::reshape(x, {1});
    *ax = 0;
    *scalar = true;
    return true;
  }
  *x1 = x;
  *scalar = false;
  return norm_axis(axis, static_cast<int>(x.ndim()), ax, "axis");
}

namespace {
mx::array unscalar(mx::array r, bool scalar) {
  return scalar ? mx::reshape(r, {}) : r;
}
}  // namespace

bool Interpreter::safe_indices(const mx::array& idx, int dim_size, const char* what,
                               mx::array* out) {
  if (!mx::issubdtype(idx.dtype(), mx::integer)) {
    return fail("%s must have an integer dtype, got %s", what, mlx_dtype_name(idx.dtype()));
  }
  if (dim_size <= 0) {
    if (idx.size() != 0) return fail("indexes into an empty axis");
    *out = idx;
    return true;
  }
  *out = normalized_indices(idx, dim_size);
  return true;
}

mx::array Interpreter::bounded(mx::array a, int bound) {
  bounded_.emplace(static_cast<std::uintptr_t>(a.id()), std::make_pair(a, bound));
  return a;
}

mx::array Interpreter::normalized_indices(const mx::array& idx, int dim_size) {
  // The normalization is element-wise, so it commutes with a view that only repeats or regroups
  // elements: a KV-cache write's indices are the positions broadcast to the cache's shape, once per
  // layer, and normalizing the positions once (instead of the broadcast copy of every layer: ~9 MLX
  // nodes each) removes ~400 nodes from a 24-layer decode step.
  // Looked up first, views included: the same view of the positions (one array: shared_view) feeds
  // every layer's cache write, and its pushed-through reshape and broadcast are made once per call.
  const auto key = std::make_pair(static_cast<std::uintptr_t>(idx.id()), dim_size);
  if (const auto it = normalized_.find(key); it != normalized_.end()) return it->second.second;
  // Indices the host holds (an input, or positions host folding computed) that are already in range need
  // nothing: reading a few of them costs less than the five nodes that would clamp them.
  if (idx.status() == mx::array::Status::available && idx.size() <= HostFold::kMostElements) {
    const auto known = kernels::known_ints(idx);
    if (known && std::all_of(known->begin(), known->end(), [&](int64_t x) { return x >= 0 && x < dim_size; })) {
      normalized_.emplace(key, std::make_pair(idx, idx));
      return idx;
    }
  }
  if (const auto it = bounded_.find(static_cast<std::uintptr_t>(idx.id()));
      it != bounded_.end() && it->second.second <= dim_size) {
    normalized_.emplace(key, std::make_pair(idx, idx));
    return idx;
  }
  if (idx.has_primitive() && idx.inputs().size() == 1) {
    const std::string kind = idx.primitive().name();
    if (kind == "Broadcast" || kind == "ExpandDims" || kind == "Reshape") {
      const mx::array inner = normalized_indices(idx.inputs()[0], dim_size);
      mx::array out = kind == "Broadcast" ? mx::broadcast_to(inner, idx.shape()) : mx::reshape(inner, idx.shape());
      normalized_.emplace(key, std::make_pair(idx, out));  // idx kept: its id stays its own for the call
      return out;
    }
  }
  // mlx gathers and scatters without bounds checks, so a bad index (e.g. a
  // corrupted constant) would read or write out of bounds. Wrap negative
  // indices like PyTorch, then clamp into [0, dim_size).
  mx::array i = idx;
  const mx::Dtype dt = i.dtype();
  if (dt.size() < 4) {
    i = mx::astype(i, mx::int32);
  }
  const mx::Dtype it = i.dtype();
  if (mx::issubdtype(it, mx::signedinteger)) {
    i = mx::where(mx::less(i, mx::array(0, it)), mx::add(i, mx::array(dim_size, it)), i);
  }
  i = mx::clip(i, mx::array(0, it), mx::array(dim_size - 1, it));
  normalized_.emplace(key, std::make_pair(idx, i));
  return i;
}

// ---------------------------------------------------------------------------
// Element-wise

bool Interpreter::exec_unary(const fb::UnaryNode& n) {
  if (take_stashed(n.out())) return true;  // a gated MLP's sigmoid, made with its linears
  const mx::array* x = read(n.x());
  if (!x) return false;
  const mx::array& a = *x;
  std::optional<mx::array> r;
  switch (n.op()) {
    case fb::UnaryOp::Neg: r = mx::negative(a); break;
    case fb::UnaryOp::Exp: r = mx::exp(a); break;
    case fb::UnaryOp::Log: r = mx::log(a); break;
    case fb::UnaryOp::Sqrt: r = mx::sqrt(a); break;
    case fb::UnaryOp::Rsqrt: r = mx::rsqrt(a); break;
    case fb::UnaryOp::Abs: r = mx::abs(a); break;
    case fb::UnaryOp::Tanh: r = program_.kernels->tanh(a); break;
    case fb::UnaryOp::Sigmoid: r = program_.kernels->sigmoid(a); break;
    case fb::UnaryOp::LogicalNot: r = mx::logical_not(a); break;
    case fb::UnaryOp::Sin: r = mx::sin(a); break;
    case fb::UnaryOp::Cos: r = mx::cos(a); break;
    case fb::UnaryOp::Floor: r = mx::floor(a); break;
    case fb::UnaryOp::Ceil: r = mx::ceil(a); break;
    case fb::UnaryOp::Erf: r = program_.kernels->erf(a); break;
    case fb::UnaryOp::Square: r = mx::square(a); break;
    case fb::UnaryOp::Log1p: r = mx::log1p(a); break;
    case fb::UnaryOp::Expm1: r = mx::expm1(a); break;
    case fb::UnaryOp::Reciprocal: r = mx::reciprocal(a); break;
    case fb::UnaryOp::Sign: r = mx::sign(a); break;
    case fb::UnaryOp::IsNan: r = mx::isnan(a); break;
    case fb::UnaryOp::IsInf: r = mx::isinf(a); break;
    case fb::UnaryOp::BitwiseNot:
      // torch.bitwise_not on bool is logical not.
      r = a.dtype() == mx::bool_ ? mx::logical_not(a) : mx::bitwise_invert(a);
      break;
    case fb::UnaryOp::Tan: r = mx::tan(a); break;
    case fb::UnaryOp::Arcsin: r = mx::arcsin(a); break;
    case fb::UnaryOp::Arccos: r = mx::arccos(a); break;
    case fb::UnaryOp::Arctan: r = mx::arctan(a); break;
    case fb::UnaryOp::Sinh: r = mx::sinh(a); break;
    case fb::UnaryOp::Cosh: r = mx::cosh(a); break;
    case fb::UnaryOp::Arcsinh: r = mx::arcsinh(a); break;
    case fb::UnaryOp::Arccosh: r = mx::arccosh(a); break;
    case fb::UnaryOp::Arctanh: r = mx::arctanh(a); break;
    case fb::UnaryOp::Log2: r = mx::log2(a); break;
    case fb::UnaryOp::Log10: r = mx::log10(a); break;
    case fb::UnaryOp::Round: r = mx::round(a); break;
  }
  if (!r) return fail("has unknown unary op %d", static_cast<int>(n.op()));
  return write(n.out(), std::move(*r));
}

bool Interpreter::exec_binary(const fb::BinaryNode& n) {
  if (take_stashed(n.out())) return true;  // a gated MLP's products, made with its linears
  const mx::array* pa = read(n.a());
  if (!pa) return false;
  const mx::array* pb = read(n.b());
  if (!pb) return false;
  const mx::array& a = *pa;
  const mx::array& b = *pb;
  if (n.op() == fb::BinaryOp::Add && pc_ < program_.norm_after_add.size() && program_.norm_after_add[pc_] >= 0 &&
      add_then_rms_norm(n, a, b)) {
    return true;
  }
  std::optional<mx::array> r;
  switch (n.op()) {
    case fb::BinaryOp::Add: r = mx::add(a, b); break;
    case fb::BinaryOp::Subtract: r = mx::subtract(a, b); break;
    case fb::BinaryOp::Multiply:
      if (program_.kernels->silu_product != nullptr) r = program_.kernels->silu_product(a, b);
      if (!r) r = mx::multiply(a, b);
      break;
    case fb::BinaryOp::Divide: r = mx::divide(a, b); break;
    case fb::BinaryOp::Power: r = mx::power(a, b); break;
    case fb::BinaryOp::Minimum: r = mx::minimum(a, b); break;
    case fb::BinaryOp::Maximum: r = mx::maximum(a, b); break;
    case fb::BinaryOp::Equal: r = mx::equal(a, b); break;
    case fb::BinaryOp::NotEqual: r = mx::not_equal(a, b); break;
    case fb::BinaryOp::Less: r = mx::less(a, b); break;
    case fb::BinaryOp::LessEqual: r = mx::less_equal(a, b); break;
    case fb::BinaryOp::Greater: r = mx::greater(a, b); break;
    case fb::BinaryOp::GreaterEqual: r = mx::greater_equal(a, b); break;
    case fb::BinaryOp::LogicalAnd: r = mx::logical_and(a, b); break;
    case fb::BinaryOp::LogicalOr: r = mx::logical_or(a, b); break;
    case fb::BinaryOp::FloorDivide: r = mx::floor_divide(a, b); break;
    case fb::BinaryOp::Remainder: r = mx::remainder(a, b); break;
    case fb::BinaryOp::BitwiseAnd: r = mx::bitwise_and(a, b); break;
    case fb::BinaryOp::BitwiseOr: r = mx::bitwise_or(a, b); break;
    case fb::BinaryOp::BitwiseXor: r = mx::bitwise_xor(a, b); break;
    case fb::BinaryOp::Arctan2: r = mx::arctan2(a, b); break;
    case fb::BinaryOp::LogAddExp: r = mx::logaddexp(a, b); break;
    case fb::BinaryOp::LeftShift: r = mx::left_shift(a, b); break;
    case fb::BinaryOp::RightShift: r = mx::right_shift(a, b); break;
  }
  if (!r) return fail("has unknown binary op %d", static_cast<int>(n.op()));
  return write(n.out(), std::move(*r));
}

bool Interpreter::exec_where(const fb::WhereNode& n) {
  const mx::array* c = read(n.cond());
  if (!c) return false;
  const mx::array* x = read(n.x());
  if (!x) return false;
  const mx::array* y = read(n.y());
  if (!y) return false;
  if (const auto known = kernels::known_uniform_bool(*c)) {
    // A condition the host holds picks a side now: the result does not depend on the other one, so the call
    // need not wait for it (a pipelined draft program's undelivered call returns state already computed).
    mx::array r = *known ? *x : *y;
    const auto dtype = mx::promote_types(x->dtype(), y->dtype());
    const auto shape = mx::broadcast_shapes(mx::broadcast_shapes(c->shape(), x->shape()), y->shape());
    if (r.dtype() != dtype) r = mx::astype(r, dtype);
    if (r.shape() != shape) r = mx::broadcast_to(r, shape);
    return write(n.out(), std::move(r));
  }
  return write(n.out(), mx::where(*c, *x, *y));
}

bool Interpreter::exec_as_type(const fb::AsTypeNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  const auto dt = to_mlx(n.dtype());
  if (!dt) return fail("has unknown dtype %d", static_cast<int>(n.dtype()));
  if (x->dtype() == *dt) return write(n.out(), *x);
  const std::vector<int> to = {static_cast<int>(dt->val()), static_cast<int>(dt->size())};
  return write(n.out(), shared_view(5, *x, to, [](const mx::array& a, const std::vector<int>& d) {
                 return mx::astype(a, mx::Dtype(static_cast<mx::Dtype::Val>(d[0]), static_cast<uint8_t>(d[1])));
               }));
}

bool Interpreter::exec_copy(const fb::CopyNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  // Arrays are immutable, so aliasing is a copy.
  return write(n.out(), *x);
}

// ---------------------------------------------------------------------------
// Creation

bool Interpreter::exec_full(const fb::FullNode& n) {
  // The array is lazy: write() refuses it before anything allocates it if it is too large.
  mx::Shape shape;
  if (!resolve_new_shape(n.shape(), &shape)) return false;
  const auto dt = to_mlx(n.dtype());
  if (!dt) return fail("has unknown dtype %d", static_cast<int>(n.dtype()));
  const double v = n.value();
  std::optional<mx::array> scalar;
  if (*dt == mx::bool_) {
    scalar = mx::array(v != 0.0);
  } else if (mx::issubdtype(*dt, mx::integer)) {
    // 2^63 is exactly representable; anything at or beyond it (or NaN) would
    // make the conversion undefined.
    if (!(v >= -9223372036854775808.0 && v < 9223372036854775808.0)) {
      return fail("fill value %g does not fit an integer tensor", v);
    }
    scalar = mx::array(static_cast<int64_t>(v), mx::int64);
  } else {
    scalar = mx::array(static_cast<float>(v), mx::float32);
  }
  return write(n.out(), mx::full(std::move(shape), *scalar, *dt));
}

bool Interpreter::exec_arange(const fb::ArangeNode& n) {
  const double start = n.start(), stop = n.stop(), step = n.step();
  if (!std::isfinite(start) || !std::isfinite(stop) || !std::isfinite(step) || step == 0.0) {
    return fail("has invalid range start=%g stop=%g step=%g", start, stop, step);
  }
  const double count = std::ceil((stop - start) / step);
  if (count > static_cast<double>(kMaxDim)) return fail("would produce %g elements", count);
  const auto dt = to_mlx(n.dtype());
  if (!dt) return fail("has unknown dtype %d", static_cast<int>(n.dtype()));
  return write(n.out(), mx::arange(start, stop, step, *dt));
}

// ---------------------------------------------------------------------------
// Reductions

bool Interpreter::exec_reduce(const fb::ReduceNode& n) {
  const mx::array* px = read(n.x());
  if (!px) return false;
  const mx::array& x = *px;
  const int ndim = static_cast<int>(x.ndim());
  std::vector<int> axes;
  if (n.axes() == nullptr) return fail("is missing its axes");
  if (n.axes()->size() == 0) {
    for (int i = 0; i < ndim; ++i) axes.push_back(i);
  } else {
    if (n.axes()->size() > static_cast<flatbuffers::uoffset_t>(std::max(ndim, 1))) {
      return fail("reduces over %u axes of a %d-d tensor", n.axes()->size(), ndim);
    }
    for (flatbuffers::uoffset_t i = 0; i < n.axes()->size(); ++i) {
      // PyTorch accepts dim 0 / -1 on a 0-d tensor (reduces over nothing).
      if (ndim == 0 && (n.axes()->Get(i) == 0 || n.axes()->Get(i) == -1)) continue;
      int a = 0;
      if (!norm_axis(n.axes()->Get(i), ndim, &a, "axis")) return false;
      if (std::find(axes.begin(), axes.end(), a) != axes.end()) {
        return fail("names axis %d twice", a);
      }
      axes.push_back(a);
    }
  }
  const bool keep = n.keepdims();
  std::optional<mx::array> r;
  switch (n.op()) {
    case fb::ReduceOp::Sum: r = mx::sum(x, axes, keep); break;
    case fb::ReduceOp::Mean: r = mx::mean(x, axes, keep); break;
    case fb::ReduceOp::Max: r = mx::max(x, axes, keep); break;
    case fb::ReduceOp::Min: r = mx::min(x, axes, keep); break;
    case fb::ReduceOp::Prod: r = mx::prod(x, axes, keep); break;
    case fb::ReduceOp::Any: r = mx::any(x, axes, keep); break;
    case fb::ReduceOp::All: r = mx::all(x, axes, keep); break;
    case fb::ReduceOp::LogSumExp: r = mx::logsumexp(x, axes, keep); break;
  }
  if (!r) return fail("has unknown reduce op %d", static_cast<int>(n.op()));
  return write(n.out(), std::move(*r));
}

bool Interpreter::exec_arg_reduce(const fb::ArgReduceNode& n) {
  const mx::array* px = read(n.x());
  if (!px) return false;
  mx::array x = *px;
  int axis = 0;
  bool scalar = false;
  if (!axis_operand(*px, n.axis(), &x, &axis, &scalar)) return false;
  if (x.shape(axis) == 0) return fail("reduces over an empty axis");
  std::optional<mx::array> r;
  switch (n.op()) {
    case fb::ArgReduceOp::ArgMax: r = mx::argmax(x, axis, n.keepdims()); break;
    case fb::ArgReduceOp::ArgMin: r = mx::argmin(x, axis, n.keepdims()); break;
  }
  if (!r) return fail("has unknown arg-reduce op %d", static_cast<int>(n.op()));
  return write(n.out(), unscalar(std::move(*r), scalar));
}

bool Interpreter::exec_softmax(const fb::SoftmaxNode& n) {
  const mx::array* px = read(n.x());
  if (!px) return false;
  mx::array x = *px;
  int axis = 0;
  bool scalar = false;
  if (!axis_operand(*px, n.axis(), &x, &axis, &scalar)) return false;
  if (n.log()) {
    return write(n.out(), unscalar(mx::subtract(x, mx::logsumexp(x, std::vector<int>{axis},
                                                                 /*keepdims=*/true)),
                                   scalar));
  }
  if (program_.kernels == &kernels::cpu_kernels() && axis == static_cast<int>(x.ndim()) - 1) {
    if (std::optional<mx::array> y = kernels::softmax_last_axis_cpu(x)) return write(n.out(), unscalar(std::move(*y), scalar));
  }
  return write(n.out(), unscalar(mx::softmax(x, std::vector<int>{axis}, /*precise=*/true), scalar));
}

bool Interpreter::exec_cumsum(const fb::CumsumNode& n) {
  const mx::array* px = read(n.x());
  if (!px) return false;
  mx::array x = *px;
  int axis = 0;
  bool scalar = false;
  if (!axis_operand(*px, n.axis(), &x, &axis, &scalar)) return false;
  return write(n.out(), unscalar(mx::cumsum(x, axis, n.reverse(), n.inclusive()), scalar));
}

bool Interpreter::exec_sort(const fb::SortNode& n) {
  const mx::array* px = read(n.x());
  if (!px) return false;
  mx::array x = *px;
  int axis = 0;
  bool scalar = false;
  if (!axis_operand(*px, n.axis(), &x, &axis, &scalar)) return false;
  return write(n.out(), unscalar(mx::sort(x, axis), scalar));
}

bool Interpreter::exec_argsort(const fb::ArgsortNode& n) {
  const mx::array* px = read(n.x());
  if (!px) return false;
  mx::array x = *px;
  int axis = 0;
  bool scalar = false;
  if (!axis_operand(*px, n.axis(), &x, &axis, &scalar)) return false;
  return write(n.out(), unscalar(mx::argsort(x, axis), scalar));
}

bool Interpreter::exec_arg_partition(const fb::ArgPartitionNode& n) {
  const mx::array* px = read(n.x());
  if (!px) return false;
  mx::array x = *px;
  int axis = 0;
  bool scalar = false;
  if (!axis_operand(*px, n.axis(), &x, &axis, &scalar)) return false;
  const int64_t dim = x.shape(axis);
  int64_t kth = n.kth() < 0 ? int64_t{n.kth()} + dim : int64_t{n.kth()};
  if (kth < 0 || kth >= dim) {
    return fail("kth %d is out of range for an axis of size %lld", n.kth(),
                static_cast<long long>(dim));
  }
  return write(n.out(), unscalar(mx::argpartition(x, static_cast<int>(kth), axis), scalar));
}

// ---------------------------------------------------------------------------
// Indexing

bool Interpreter::exec_take_along_axis(const fb::TakeAlongAxisNode& n) {
  const mx::array* px = read(n.x());
  if (!px) return false;
  const mx::array* pidx = read(n.indices());
  if (!pidx) return false;
  if (pidx->ndim() != px->ndim()) {
    return fail("indices have rank %zu but the input has rank %zu", pidx->ndim(), px->ndim());
  }
  mx::array x = *px;
  int axis = 0;
  bool scalar = false;
  if (!axis_operand(*px, n.axis(), &x, &axis, &scalar)) return false;
  const mx::array idx = scalar ? mx::reshape(*pidx, {1}) : *pidx;
  mx::array safe = idx;
  if (!safe_indices(idx, x.shape(axis), "indices", &safe)) return false;
  return write(n.out(), unscalar(mx::take_along_axis(x, safe, axis), scalar));
}

bool Interpreter::exec_take(const fb::TakeNode& n) {
  const mx::array* px = read(n.x());
  if (!px) return false;
  const mx::array* idx = read(n.indices());
  if (!idx) return false;
  mx::array x = *px;
  int axis = 0;
  bool scalar = false;
  if (!axis_operand(*px, n.axis(), &x, &axis, &scalar)) return false;
  mx::array safe = *idx;
  if (!safe_indices(*idx, x.shape(axis), "indices", &safe)) return false;
  // Result shape: x.shape[:axis] + indices.shape + x.shape[axis+1:].
  return write(n.out(), mx::take(x, safe, axis));
}

bool Interpreter::exec_put_along_axis(const fb::PutAlongAxisNode& n) {
  const mx::array* px = read(n.x());
  if (!px) return false;
  const mx::array* pidx = read(n.indices());
  if (!pidx) return false;
  const mx::array* pvals = read(n.values());
  if (!pvals) return false;
  if (pidx->ndim() != px->ndim()) {
    return fail("indices have rank %zu but the input has rank %zu", pidx->ndim(), px->ndim());
  }
  mx::array x = *px;
  int axis = 0;
  bool scalar = false;
  if (!axis_operand(*px, n.axis(), &x, &axis, &scalar)) return false;
  const mx::array idx = scalar ? mx::reshape(*pidx, {1}) : *pidx;
  const mx::array vals = scalar && pvals->ndim() == 0 ? mx::reshape(*pvals, {1}) : *pvals;
  mx::array safe = idx;
  if (!safe_indices(idx, x.shape(axis), "indices", &safe)) return false;
  std::optional<mx::array> r;
  switch (n.mode()) {
    case fb::ScatterMode::Replace: r = mx::put_along_axis(x, safe, vals, axis); break;
    case fb::ScatterMode::Add: r = mx::scatter_add_axis(x, safe, vals, axis); break;
  }
  if (!r) return fail("has unknown scatter mode %d", static_cast<int>(n.mode()));
  return write(n.out(), unscalar(std::move(*r), scalar));
}

// ---------------------------------------------------------------------------
// Shape

bool Interpreter::exec_reshape(const fb::ReshapeNode& n) {
  if (take_stashed(n.out())) return true;  // a projection's view, made with it (linear_groups.h)
  const mx::array* x = read(n.x());
  if (!x) return false;
  std::vector<int64_t> dims;
  if (!resolve_shape(n.shape(), &dims)) return false;
  mx::Shape shape;
  int inferred = 0;
  for (int64_t d : dims) {
    if (d == -1) {
      if (++inferred > 1) return fail("has more than one -1 in its shape");
    } else if (d < 0 || d > kMaxDim) {
      return fail("has invalid size %lld", static_cast<long long>(d));
    }
    shape.push_back(static_cast<int32_t>(d));
  }
  if (!checked_numel(dims, /*skip_minus_one=*/true)) return fail("has a shape that is too large");
  return write(n.out(), shared_view(0, *x, std::vector<int>(shape.begin(), shape.end()),
                                    [](const mx::array& a, const std::vector<int>& sh) {
                                      return mx::reshape(a, mx::Shape(sh.begin(), sh.end()));
                                    }));
}

mx::array Interpreter::shared_view(int op, const mx::array& x, std::vector<int> args,
                                   mx::array (*make)(const mx::array&, const std::vector<int>&)) {
  // Small arrays only: a kept view keeps its input alive to the end of the call, which for activations
  // (a prefill's) would hold memory MLX could otherwise reuse.
  if (x.size() > kMaxShared) return make(x, args);
  auto key = std::make_tuple(op, x.id(), std::move(args));
  auto it = views_.find(key);
  if (it != views_.end()) return it->second;
  mx::array out = make(x, std::get<2>(key));
  views_.emplace(std::move(key), out);
  return out;
}

bool Interpreter::exec_transpose(const fb::TransposeNode& n) {
  if (take_stashed(n.out())) return true;  // a projection's view, made with it (linear_groups.h)
  const mx::array* x = read(n.x());
  if (!x) return false;
  const int ndim = static_cast<int>(x->ndim());
  if (n.perm() == nullptr) return fail("is missing its permutation");
  if (n.perm()->size() != static_cast<flatbuffers::uoffset_t>(ndim)) {
    return fail("permutation has %u entries for a %d-d tensor", n.perm()->size(), ndim);
  }
  std::vector<int> perm;
  std::vector<bool> seen(ndim, false);
  for (flatbuffers::uoffset_t i = 0; i < n.perm()->size(); ++i) {
    int a = 0;
    if (!norm_axis(n.perm()->Get(i), ndim, &a, "permutation entry")) return false;
    if (seen[a]) return fail("permutation names axis %d twice", a);
    seen[a] = true;
    perm.push_back(a);
  }
  return write(n.out(), shared_view(1, *x, std::move(perm), [](const mx::array& a, const std::vector<int>& p) {
                 return mx::transpose(a, p);
               }));
}

bool Interpreter::exec_expand_dims(const fb::ExpandDimsNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  int axis = 0;
  if (!norm_axis(n.axis(), static_cast<int>(x->ndim()) + 1, &axis, "axis")) return false;
  return write(n.out(), shared_view(2, *x, {axis}, [](const mx::array& a, const std::vector<int>& ax) {
                 return mx::expand_dims(a, ax[0]);
               }));
}

bool Interpreter::exec_squeeze(const fb::SqueezeNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  const int ndim = static_cast<int>(x->ndim());
  if (n.axes() == nullptr) return fail("is missing its axes");
  // PyTorch semantics: only size-1 axes are removed, others are ignored; no
  // axes means every size-1 axis.
  std::vector<int> axes;
  if (n.axes()->size() == 0) {
    for (int i = 0; i < ndim; ++i) {
      if (x->shape(i) == 1) axes.push_back(i);
    }
  } else {
    for (flatbuffers::uoffset_t i = 0; i < n.axes()->size(); ++i) {
      if (ndim == 0 && (n.axes()->Get(i) == 0 || n.axes()->Get(i) == -1)) continue;
      int a = 0;
      if (!norm_axis(n.axes()->Get(i), ndim, &a, "axis")) return false;
      if (x->shape(a) == 1 && std::find(axes.begin(), axes.end(), a) == axes.end()) {
        axes.push_back(a);
      }
    }
  }
  if (axes.empty()) return write(n.out(), *x);
  return write(n.out(), mx::squeeze(*x, axes));
}

bool Interpreter::exec_broadcast_to(const fb::BroadcastToNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  std::vector<int64_t> dims;
  if (!resolve_shape(n.shape(), &dims)) return false;
  const int ndim = static_cast<int>(x->ndim());
  const int out_ndim = static_cast<int>(dims.size());
  if (out_ndim < ndim) return fail("cannot broadcast a %d-d tensor to rank %d", ndim, out_ndim);
  mx::Shape shape;
  for (int i = 0; i < out_ndim; ++i) {
    int64_t d = dims[i];
    const int src = i - (out_ndim - ndim);  // aligned from the right
    if (d == -1 && src >= 0) d = x->shape(src);  // torch.expand: -1 keeps the size
    if (d < 0 || d > kMaxDim) return fail("has invalid size %lld", static_cast<long long>(d));
    shape.push_back(static_cast<int32_t>(d));
  }
  if (!checked_numel(shape)) return fail("has a shape that is too large");
  return write(n.out(), shared_view(3, *x, std::vector<int>(shape.begin(), shape.end()),
                                    [](const mx::array& a, const std::vector<int>& sh) {
                                      return mx::broadcast_to(a, mx::Shape(sh.begin(), sh.end()));
                                    }));
}

bool Interpreter::exec_slice(const fb::SliceNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  const int ndim = static_cast<int>(x->ndim());
  int axis = 0;
  if (!norm_axis(n.axis(), ndim, &axis, "axis")) return false;
  if (n.step() < 1) return fail("has step %d (must be >= 1)", n.step());
  int64_t start = 0, stop = 0;
  if (!resolve(n.start(), &start) || !resolve(n.stop(), &stop)) return false;
  const int64_t dim = x->shape(axis);
  // PyTorch semantics: negative bounds count from the end, then clamp.
  if (start < 0) start = start < -dim ? 0 : start + dim;
  if (stop < 0) stop = stop < -dim ? 0 : stop + dim;
  start = std::clamp<int64_t>(start, 0, dim);
  stop = std::clamp<int64_t>(stop, start, dim);
  mx::Shape lo(ndim, 0), hi(x->shape()), strides(ndim, 1);
  lo[axis] = static_cast<int32_t>(start);
  hi[axis] = static_cast<int32_t>(stop);
  strides[axis] = n.step();
  return write(n.out(), mx::slice(*x, std::move(lo), std::move(hi), std::move(strides)));
}

bool Interpreter::exec_concat(const fb::ConcatNode& n) {
  if (n.xs() == nullptr || n.xs()->size() == 0) return fail("has no inputs");
  std::vector<mx::array> xs;
  xs.reserve(n.xs()->size());
  for (flatbuffers::uoffset_t i = 0; i < n.xs()->size(); ++i) {
    const mx::array* x = read(n.xs()->Get(i));
    if (!x) return false;
    xs.push_back(*x);
  }
  const int ndim = static_cast<int>(xs[0].ndim());
  int axis = 0;
  if (!norm_axis(n.axis(), ndim, &axis, "axis")) return false;
  int64_t total = 0;
  for (const auto& x : xs) {
    if (static_cast<int>(x.ndim()) != ndim) {
      return fail("concatenates tensors of ranks %d and %zu", ndim, x.ndim());
    }
    total += x.shape(axis);
  }
  if (total > kMaxDim) return fail("result axis of size %lld is too large", static_cast<long long>(total));
  return write(n.out(), mx::concatenate(std::move(xs), axis));
}

// ---------------------------------------------------------------------------
// Linear algebra

bool Interpreter::exec_matmul(const fb::MatmulNode& n) {
  const mx::array* a = read(n.a());
  if (!a) return false;
  const mx::array* b = read(n.b());
  if (!b) return false;
  return write(n.out(), program_.kernels->matmul(*a, *b));
}

bool Interpreter::exec_addmm(const fb::AddmmNode& n) {
  const mx::array* bias = read(n.bias());
  if (!bias) return false;
  const mx::array* a = read(n.a());
  if (!a) return false;
  const mx::array* b = read(n.b());
  if (!b) return false;
  return write(n.out(), program_.kernels->addmm(*bias, *a, *b, static_cast<float>(n.alpha()),
                                     static_cast<float>(n.beta())));
}

// ---------------------------------------------------------------------------
// Symbolic sizes

bool Interpreter::exec_sym_size(const fb::SymSizeNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  int axis = 0;
  if (!norm_axis(n.axis(), static_cast<int>(x->ndim()), &axis, "axis")) return false;
  return write_value(n.out(), x->shape(axis));
}

}  // namespace etmlx
