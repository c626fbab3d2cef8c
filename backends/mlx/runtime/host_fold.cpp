#include "host_fold.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include <mlx/backend/cuda/cuda.h>
#include <mlx/primitives.h>

#include "kernels/known_values.h"

namespace etmlx {

namespace mx = mlx::core;

namespace {

constexpr int kMostDepth = 32;

bool supported(mx::Dtype t) { return t == mx::bool_ || t == mx::int32 || t == mx::int64 || t == mx::float32; }

size_t count(const std::vector<int32_t>& shape) {
  size_t n = 1;
  for (int32_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

bool is_float(const HostValue& v) { return v.dtype == mx::float32; }
size_t size_of(const HostValue& v) { return is_float(v) ? v.floats.size() : v.ints.size(); }

// An integer result in its dtype's range, as MLX's (two's complement wrap for int32, 0/1 for bool).
int64_t wrap(int64_t x, mx::Dtype t) {
  if (t == mx::bool_) return x != 0;
  if (t == mx::int32) return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(x)));
  return x;
}

// Steps `idx` to the next row-major position of `shape` (the last axis fastest).
template <typename I, typename S>
void next_position(std::vector<I>& idx, const S& shape) {
  for (size_t d = idx.size(); d-- > 0;) {
    if (++idx[d] < shape[d]) return;
    idx[d] = 0;
  }
}

// The accumulations of MLX's Reduce and Scan that are exact on integers (their own enums differ).
enum class Combine { Sum, Prod, Min, Max, And, Or };

int64_t combine(Combine op, int64_t acc, int64_t v) {
  switch (op) {
    case Combine::Sum: return static_cast<int64_t>(static_cast<uint64_t>(acc) + static_cast<uint64_t>(v));
    case Combine::Prod: return static_cast<int64_t>(static_cast<uint64_t>(acc) * static_cast<uint64_t>(v));
    case Combine::Min: return std::min(acc, v);
    case Combine::Max: return std::max(acc, v);
    case Combine::And: return acc && v;
    case Combine::Or: return acc || v;
  }
  return acc;
}

// The Combine of MLX's Reduce::ReduceType or Scan::ReduceType (the same names in two enums); nullopt for
// Scan's LogAddExp.
template <typename Type>
std::optional<Combine> combine_of(Type type) {
  if (type == Type::Sum) return Combine::Sum;
  if (type == Type::Prod) return Combine::Prod;
  if (type == Type::Min) return Combine::Min;
  if (type == Type::Max) return Combine::Max;
  if constexpr (std::is_same_v<Type, mx::Reduce::ReduceType>) {
    if (type == Type::And) return Combine::And;
    if (type == Type::Or) return Combine::Or;
  }
  return std::nullopt;
}

// What an empty run of `op` gives (a reduction over no elements, an exclusive scan's first); nullopt for min
// and max, which have none MLX would agree on.
std::optional<int64_t> identity(Combine op) {
  switch (op) {
    case Combine::Sum: case Combine::Or: return 0;
    case Combine::Prod: case Combine::And: return 1;
    default: return std::nullopt;
  }
}

template <typename T>
void read_elements(const mx::array& a, HostValue& out) {
  // A materialised array may be a strided view: walk its logical row-major order through its strides.
  const T* base = a.data<T>();
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const size_t n = a.size();
  const size_t rank = shape.size();
  std::vector<int64_t> idx(rank, 0);
  for (size_t k = 0; k < n; ++k) {
    int64_t offset = 0;
    for (size_t d = 0; d < rank; ++d) offset += idx[d] * static_cast<int64_t>(strides[d]);
    const T x = base[offset];
    if constexpr (std::is_same_v<T, float>) {
      out.floats.push_back(x);
    } else {
      out.ints.push_back(static_cast<int64_t>(x));
    }
    next_position(idx, shape);
  }
}

std::optional<HostValue> read(const mx::array& a) {
  HostValue v;
  v.shape.assign(a.shape().begin(), a.shape().end());
  v.dtype = a.dtype();
  if (a.dtype() == mx::bool_) read_elements<bool>(a, v);
  else if (a.dtype() == mx::int32) read_elements<int32_t>(a, v);
  else if (a.dtype() == mx::int64) read_elements<int64_t>(a, v);
  else if (a.dtype() == mx::float32) read_elements<float>(a, v);
  else return std::nullopt;
  return v;
}

// x's elements at the positions of `shape` (x broadcast to it, right-aligned as MLX broadcasts).
std::optional<HostValue> broadcast(const HostValue& x, const std::vector<int32_t>& shape) {
  if (x.shape.size() > shape.size()) return std::nullopt;
  const size_t lead = shape.size() - x.shape.size();
  std::vector<int64_t> in_strides(x.shape.size(), 0);
  int64_t s = 1;
  for (size_t d = x.shape.size(); d-- > 0;) {
    if (x.shape[d] != 1 && x.shape[d] != shape[lead + d]) return std::nullopt;
    in_strides[d] = x.shape[d] == 1 ? 0 : s;
    s *= x.shape[d];
  }
  HostValue out;
  out.shape = shape;
  out.dtype = x.dtype;
  const size_t n = count(shape);
  std::vector<int32_t> idx(shape.size(), 0);
  for (size_t k = 0; k < n; ++k) {
    int64_t at = 0;
    for (size_t d = 0; d < x.shape.size(); ++d) at += idx[lead + d] * in_strides[d];
    if (is_float(x)) out.floats.push_back(x.floats[static_cast<size_t>(at)]);
    else out.ints.push_back(x.ints[static_cast<size_t>(at)]);
    next_position(idx, shape);
  }
  return out;
}

std::optional<HostValue> cast(const HostValue& x, mx::Dtype to) {
  HostValue out;
  out.shape = x.shape;
  out.dtype = to;
  if (to == mx::float32) {
    if (is_float(x)) return x;
    for (int64_t v : x.ints) out.floats.push_back(static_cast<float>(v));
    return out;
  }
  if (is_float(x)) {
    for (float v : x.floats) {
      if (to == mx::bool_) {
        out.ints.push_back(v != 0.0f);
        continue;
      }
      // Out of range (or NaN) is undefined in a cast: leave such a value to MLX.
      if (!std::isfinite(v) || std::fabs(v) >= 9.0e18f) return std::nullopt;
      out.ints.push_back(wrap(static_cast<int64_t>(v), to));
    }
    return out;
  }
  for (int64_t v : x.ints) out.ints.push_back(wrap(v, to));
  return out;
}

// Elementwise over equally shaped operands (MLX's ops broadcast their inputs before the primitive).
template <typename IntOp, typename FloatOp>
std::optional<HostValue> binary(const HostValue& a, const HostValue& b, mx::Dtype out_type, IntOp int_op,
                                FloatOp float_op) {
  if (a.shape != b.shape || a.dtype != b.dtype) return std::nullopt;
  HostValue out;
  out.shape = a.shape;
  out.dtype = out_type;
  const size_t n = size_of(a);
  for (size_t k = 0; k < n; ++k) {
    if (is_float(a)) {
      const auto r = float_op(a.floats[k], b.floats[k]);
      if (!r) return std::nullopt;
      if (out_type == mx::float32) out.floats.push_back(static_cast<float>(*r));
      else out.ints.push_back(wrap(static_cast<int64_t>(*r), out_type));
    } else {
      const auto r = int_op(a.ints[k], b.ints[k]);
      if (!r) return std::nullopt;
      out.ints.push_back(wrap(*r, out_type));
    }
  }
  return out;
}

using MaybeInt = std::optional<int64_t>;
using MaybeFloat = std::optional<double>;
const auto kNoFloat = [](float, float) -> MaybeFloat { return std::nullopt; };

std::optional<HostValue> binary_named(std::string_view kind, const HostValue& a, const HostValue& b,
                                      mx::Dtype out_type) {
  const auto cmp = [&](auto op) {
    return binary(a, b, out_type, [&](int64_t x, int64_t y) -> MaybeInt { return op(x, y) ? 1 : 0; },
                  [&](float x, float y) -> MaybeFloat { return op(x, y) ? 1.0 : 0.0; });
  };
  if (kind == "Less") return cmp([](auto x, auto y) { return x < y; });
  if (kind == "LessEqual") return cmp([](auto x, auto y) { return x <= y; });
  if (kind == "Greater") return cmp([](auto x, auto y) { return x > y; });
  if (kind == "GreaterEqual") return cmp([](auto x, auto y) { return x >= y; });
  if (kind == "Equal") return cmp([](auto x, auto y) { return x == y; });
  if (kind == "NotEqual") return cmp([](auto x, auto y) { return x != y; });
  // Integer arithmetic wraps as int64 (two's complement, combine()), then as the dtype.
  const auto with = [](Combine op) { return [op](int64_t x, int64_t y) -> MaybeInt { return combine(op, x, y); }; };
  const auto add = with(Combine::Sum), mul = with(Combine::Prod);
  const auto sub = [](int64_t x, int64_t y) -> MaybeInt {
    return static_cast<int64_t>(static_cast<uint64_t>(x) - static_cast<uint64_t>(y));
  };
  // float32 add, subtract and multiply are single IEEE operations: the same result on any device.
  if (kind == "Add" && a.dtype != mx::bool_)
    return binary(a, b, out_type, add, [](float x, float y) -> MaybeFloat { return static_cast<float>(x + y); });
  if (kind == "Subtract" && a.dtype != mx::bool_)
    return binary(a, b, out_type, sub, [](float x, float y) -> MaybeFloat { return static_cast<float>(x - y); });
  if (kind == "Multiply" && a.dtype != mx::bool_)
    return binary(a, b, out_type, mul, [](float x, float y) -> MaybeFloat { return static_cast<float>(x * y); });
  // Minimum and Maximum only on integers (a NaN's handling is the device's).
  if (kind == "Minimum") return binary(a, b, out_type, with(Combine::Min), kNoFloat);
  if (kind == "Maximum") return binary(a, b, out_type, with(Combine::Max), kNoFloat);
  if (kind == "LogicalAnd") return binary(a, b, out_type, with(Combine::And), kNoFloat);
  if (kind == "LogicalOr") return binary(a, b, out_type, with(Combine::Or), kNoFloat);
  if (kind == "BitwiseAnd") return binary(a, b, out_type, [](int64_t x, int64_t y) -> MaybeInt { return x & y; }, kNoFloat);
  if (kind == "BitwiseOr") return binary(a, b, out_type, [](int64_t x, int64_t y) -> MaybeInt { return x | y; }, kNoFloat);
  if (kind == "BitwiseXor") return binary(a, b, out_type, [](int64_t x, int64_t y) -> MaybeInt { return x ^ y; }, kNoFloat);
  return std::nullopt;
}

std::optional<HostValue> reduce(const mx::Reduce& p, const HostValue& x, const std::vector<int32_t>& out_shape) {
  if (is_float(x)) return std::nullopt;  // float sums depend on the device's order
  const auto [type, axes] = p.state();
  const auto combined = combine_of(type);
  if (!combined) return std::nullopt;
  const Combine op = *combined;
  const size_t rank = x.shape.size();
  if (out_shape.size() != rank) return std::nullopt;  // MLX's Reduce keeps the reduced axes as 1
  std::vector<bool> reduced(rank, false);
  for (int ax : axes) {
    if (ax < 0 || static_cast<size_t>(ax) >= rank) return std::nullopt;
    reduced[static_cast<size_t>(ax)] = true;
  }
  HostValue out;
  out.shape = out_shape;
  out.dtype = x.dtype;
  const size_t n_out = count(out_shape);
  std::vector<bool> seen(n_out, false);
  out.ints.assign(n_out, 0);
  std::vector<int32_t> idx(rank, 0);
  for (size_t k = 0; k < x.ints.size(); ++k) {
    size_t at = 0;
    for (size_t d = 0; d < rank; ++d) at = at * static_cast<size_t>(out_shape[d]) + (reduced[d] ? 0 : idx[d]);
    const int64_t v = x.ints[k];
    int64_t& acc = out.ints[at];
    if (!seen[at]) {
      acc = v;
      seen[at] = true;
    } else {
      acc = combine(op, acc, v);
    }
    next_position(idx, x.shape);
  }
  for (size_t k = 0; k < n_out; ++k) {
    if (!seen[k]) {  // an empty reduction: its identity
      const auto empty = identity(op);
      if (!empty) return std::nullopt;
      out.ints[k] = *empty;
    }
    out.ints[k] = wrap(out.ints[k], out.dtype);
  }
  return out;
}

std::optional<HostValue> scan(const mx::Scan& p, const HostValue& x) {
  if (is_float(x)) return std::nullopt;
  const auto [type, axis, reverse, inclusive] = p.state();
  const int rank = static_cast<int>(x.shape.size());
  if (axis < 0 || axis >= rank) return std::nullopt;
  const auto combined = combine_of(type);  // none for LogAddExp: floating point
  if (!combined) return std::nullopt;
  const Combine op = *combined;
  HostValue out = x;
  const int64_t len = x.shape[static_cast<size_t>(axis)];
  int64_t inner = 1;
  for (int d = axis + 1; d < rank; ++d) inner *= x.shape[static_cast<size_t>(d)];
  const int64_t outer = len == 0 ? 0 : static_cast<int64_t>(x.ints.size()) / (len * inner);
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < inner; ++i) {
      int64_t acc = 0;
      bool started = false;
      for (int64_t step = 0; step < len; ++step) {
        const int64_t j = reverse ? len - 1 - step : step;
        const size_t at = static_cast<size_t>((o * len + j) * inner + i);
        const int64_t v = x.ints[at];
        const int64_t before = acc;
        if (!started) {
          acc = v;
          started = true;
        } else {
          acc = combine(op, acc, v);
        }
        acc = wrap(acc, x.dtype);
        if (inclusive) {
          out.ints[at] = acc;
        } else {
          if (step == 0) {  // the exclusive scan's first element is the identity
            const auto empty = identity(op);
            if (!empty) return std::nullopt;
            out.ints[at] = *empty;
          } else {
            out.ints[at] = before;
          }
        }
      }
    }
  }
  return out;
}

std::optional<HostValue> gather_axis(int axis, const HostValue& src, const HostValue& idx) {
  const size_t rank = src.shape.size();
  if (is_float(idx) || idx.shape.size() != rank || axis < 0 || static_cast<size_t>(axis) >= rank) return std::nullopt;
  HostValue out;
  out.shape = idx.shape;
  out.dtype = src.dtype;
  const size_t n = idx.ints.size();
  std::vector<int32_t> at(rank, 0);
  const int64_t len = src.shape[static_cast<size_t>(axis)];
  for (size_t k = 0; k < n; ++k) {
    int64_t j = idx.ints[k];
    if (j < 0) j += len;
    if (j < 0 || j >= len) return std::nullopt;  // out of range: the device's business
    size_t flat = 0;
    for (size_t d = 0; d < rank; ++d) {
      const int64_t coord = d == static_cast<size_t>(axis) ? j : at[d];
      if (coord >= src.shape[d]) return std::nullopt;
      flat = flat * static_cast<size_t>(src.shape[d]) + static_cast<size_t>(coord);
    }
    if (is_float(src)) out.floats.push_back(src.floats[flat]);
    else out.ints.push_back(src.ints[flat]);
    next_position(at, idx.shape);
  }
  return out;
}

// MLX's Gather: out[i..., s...] = src[s + idx(i) on the gathered axes]; out's shape is the indices' shape and then
// slice_sizes (the interpreter normalises indices before it gathers; one out of range is left to the device).
std::optional<HostValue> gather(const std::vector<int>& axes, const mx::Shape& slice_sizes, const HostValue& src,
                                const std::vector<const HostValue*>& indices) {
  const size_t rank = src.shape.size();
  if (axes.size() != indices.size() || slice_sizes.size() != rank || indices.empty()) return std::nullopt;
  for (const HostValue* idx : indices)
    if (is_float(*idx) || idx->shape != indices[0]->shape) return std::nullopt;
  std::vector<int> slot(rank, -1);  // which index array moves axis d
  for (size_t k = 0; k < axes.size(); ++k) {
    if (axes[k] < 0 || static_cast<size_t>(axes[k]) >= rank) return std::nullopt;
    slot[static_cast<size_t>(axes[k])] = static_cast<int>(k);
  }
  std::vector<int32_t> slice(slice_sizes.begin(), slice_sizes.end());
  HostValue out;
  out.shape = indices[0]->shape;
  out.shape.insert(out.shape.end(), slice.begin(), slice.end());
  out.dtype = src.dtype;
  const size_t n_idx = indices[0]->ints.size(), n_slice = count(slice);
  std::vector<int32_t> at(rank, 0);
  for (size_t i = 0; i < n_idx; ++i) {
    std::fill(at.begin(), at.end(), 0);
    for (size_t k = 0; k < n_slice; ++k) {
      size_t flat = 0;
      for (size_t d = 0; d < rank; ++d) {
        const int64_t coord = at[d] + (slot[d] >= 0 ? indices[static_cast<size_t>(slot[d])]->ints[i] : 0);
        if (coord < 0 || coord >= src.shape[d]) return std::nullopt;
        flat = flat * static_cast<size_t>(src.shape[d]) + static_cast<size_t>(coord);
      }
      if (is_float(src)) out.floats.push_back(src.floats[flat]);
      else out.ints.push_back(src.ints[flat]);
      next_position(at, slice);
    }
  }
  return out;
}

// The result of an operation one of whose operands decides it whatever the other holds (x and false, x or true,
// x * 0 for integers), when that operand is known and already of the result's shape; else nullopt.
std::optional<HostValue> absorbed(std::string_view kind, const std::vector<const HostValue*>& in,
                                  const std::vector<int32_t>& shape, mx::Dtype out_type) {
  if (in.size() != 2 || out_type == mx::float32) return std::nullopt;
  const bool logical = out_type == mx::bool_;
  int64_t absorbing = 0;
  if ((kind == "LogicalAnd" || kind == "BitwiseAnd") && logical) absorbing = 0;
  else if ((kind == "LogicalOr" || kind == "BitwiseOr") && logical) absorbing = 1;
  else if (kind == "Multiply" && !logical) absorbing = 0;
  else return std::nullopt;
  for (const HostValue* v : in) {
    if (v == nullptr || is_float(*v) || v->shape != shape || v->dtype != out_type) continue;
    if (std::all_of(v->ints.begin(), v->ints.end(), [&](int64_t x) { return x == absorbing; })) return *v;
  }
  return std::nullopt;
}

mx::array to_array(const HostValue& v) {
  const mx::Shape shape(v.shape.begin(), v.shape.end());
  if (v.dtype == mx::float32) return mx::array(v.floats.begin(), shape, mx::float32);
  if (v.dtype == mx::int64) return mx::array(v.ints.begin(), shape, mx::int64);
  if (v.dtype == mx::int32) {
    std::vector<int32_t> x(v.ints.begin(), v.ints.end());
    return mx::array(x.begin(), shape, mx::int32);
  }
  std::unique_ptr<bool[]> x(new bool[v.ints.size() > 0 ? v.ints.size() : 1]);
  for (size_t k = 0; k < v.ints.size(); ++k) x[k] = v.ints[k] != 0;
  return mx::array(x.get(), shape, mx::bool_);
}

// An arange of whole numbers (start and step integers, every value exact in the dtype: a float32 one below 2^24),
// such as the proposing program's offset of each step's one position (llm/decoder/proposer.py); else nullopt.
std::optional<HostValue> arange(const std::tuple<double, double, double>& state, const std::vector<int32_t>& shape,
                                mx::Dtype dtype) {
  const double start = std::get<0>(state), step = std::get<2>(state);  // the shape already says how many
  if (shape.size() != 1 || dtype == mx::bool_ || start != std::floor(start) || step != std::floor(step)) {
    return std::nullopt;
  }
  const double last = start + step * std::max(0, shape[0] - 1);
  const double limit = dtype == mx::float32 ? 16777216.0 : dtype == mx::int32 ? 2147483647.0 : 9.0e15;
  if (std::fabs(start) > limit || std::fabs(last) > limit) return std::nullopt;
  HostValue v;
  v.shape = shape;
  v.dtype = dtype;
  for (int32_t k = 0; k < shape[0]; ++k) {
    const double x = start + step * k;
    if (dtype == mx::float32) v.floats.push_back(static_cast<float>(x));
    else v.ints.push_back(static_cast<int64_t>(x));
  }
  return v;
}

}  // namespace

bool HostFold::enabled_on(const mx::Device& device, options::Forced forced) {
  if (forced != options::Forced::unset) return forced == options::Forced::on;
  return !(device.type == mx::Device::gpu && mx::cu::is_available());
}

const HostValue* HostFold::value(const mx::array& a, int depth) {
  const auto key = a.id();
  if (auto it = memo_.find(key); it != memo_.end()) return it->second ? &*it->second : nullptr;
  // Keeps `a` referenced until clear(), so its id is not reused by another array in this build.
  keep_.push_back(a);
  auto& slot = memo_[key];
  if (!supported(a.dtype()) || a.size() > kMostElements) return nullptr;
  // status() rather than is_available(): the latter waits on an evaluation in flight.
  if (a.status() == mx::array::Status::available) {
    slot = read(a);
    return slot ? &*slot : nullptr;
  }
  if (!a.has_primitive() || depth >= kMostDepth || a.siblings().size() > 0) return nullptr;
  std::vector<const HostValue*> in;
  bool all_known = true;
  for (const auto& x : a.inputs()) {
    in.push_back(value(x, depth + 1));
    all_known = all_known && in.back() != nullptr;
  }
  const std::vector<int32_t> shape(a.shape().begin(), a.shape().end());
  // A view of the primitive's own name: no allocation per node (this runs for every small array of a build).
  const std::string_view kind = a.primitive().name();
  if (!all_known) {  // a draft program's call without drafts: "is draft i a hit" is false whatever was sampled
    auto r = absorbed(kind, in, shape, a.dtype());
    if (!r) return nullptr;
    slot = std::move(r);
    return &*slot;
  }
  std::optional<HostValue> r;
  if (in.empty() && kind == "Arange") {
    r = arange(static_cast<const mx::Arange&>(a.primitive()).state(), shape, a.dtype());
  } else if (in.size() == 1 && (kind == "Reshape" || kind == "ExpandDims" || kind == "Squeeze" || kind == "Copy" ||
                         kind == "Contiguous" || kind == "Flatten" || kind == "Unflatten")) {
    if (count(shape) == size_of(*in[0]) && in[0]->dtype == a.dtype()) {
      r = *in[0];
      r->shape = shape;
    }
  } else if (in.size() == 1 && (kind == "Broadcast" || kind == "Full")) {
    r = broadcast(*in[0], shape);
    if (r && r->dtype != a.dtype()) r = cast(*r, a.dtype());
  } else if (in.size() == 1 && kind == "AsType") {
    r = cast(*in[0], a.dtype());
  } else if (in.size() == 1 && kind == "LogicalNot" && in[0]->dtype == mx::bool_) {
    r = *in[0];
    for (auto& v : r->ints) v = !v;
  } else if (in.size() == 1 && kind == "Negative" && !is_float(*in[0]) && in[0]->dtype != mx::bool_) {
    r = *in[0];
    for (auto& v : r->ints) v = wrap(static_cast<int64_t>(0ULL - static_cast<uint64_t>(v)), r->dtype);
  } else if (in.size() == 2 && kind != "GatherAxis") {
    r = binary_named(kind, *in[0], *in[1], a.dtype());
  } else if (in.size() == 3 && kind == "Select") {
    const HostValue &c = *in[0], &x = *in[1], &y = *in[2];
    if (c.shape == shape && x.shape == shape && y.shape == shape && x.dtype == y.dtype && x.dtype == a.dtype()) {
      r = x;
      for (size_t k = 0; k < c.ints.size(); ++k) {
        if (c.ints[k]) continue;
        if (is_float(x)) r->floats[k] = y.floats[k];
        else r->ints[k] = y.ints[k];
      }
    }
  }
  // By name, not dynamic_cast: libmlx does not export every primitive's type information. Each of these
  // names is only ever that primitive's.
  if (!r && in.size() == 1 && in[0]->dtype == a.dtype()) {
    if (kind == "Sum" || kind == "Prod" || kind == "Min" || kind == "Max" || kind == "And" || kind == "Or")
      r = reduce(static_cast<const mx::Reduce&>(a.primitive()), *in[0], shape);
    else if (kind == "CumSum" || kind == "CumProd" || kind == "CumMin" || kind == "CumMax")
      r = scan(static_cast<const mx::Scan&>(a.primitive()), *in[0]);
  }
  if (!r && in.size() >= 2 && kind == "Gather") {
    const auto [axes, slice_sizes] = static_cast<const mx::Gather&>(a.primitive()).state();
    r = gather(axes, slice_sizes, *in[0], std::vector<const HostValue*>(in.begin() + 1, in.end()));
  }
  if (!r && in.size() == 2 && kind == "GatherAxis")
    r = gather_axis(static_cast<const mx::GatherAxis&>(a.primitive()).state(), *in[0], *in[1]);
  if (!r || r->shape != shape || r->dtype != a.dtype() || size_of(*r) != count(shape)) return nullptr;
  slot = std::move(r);
  return &*slot;
}

std::optional<mx::array> HostFold::fold(const mx::array& a) {
  if (a.status() == mx::array::Status::available || !a.has_primitive() || !supported(a.dtype()) ||
      a.size() > kMostElements)
    return std::nullopt;
  // A view of what the host already holds is left as it is: the interpreter shares such views between layers
  // (one array per call: shared_view, normalized_indices), which a fresh array per layer would undo.
  if (kernels::is_view(a) && a.inputs()[0].status() == mx::array::Status::available) return std::nullopt;
  const HostValue* v = value(a, 0);
  if (!v) return std::nullopt;
  return to_array(*v);
}

}  // namespace etmlx
