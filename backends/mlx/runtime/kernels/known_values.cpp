#include "kernels/known_values.h"

#include <algorithm>
#include <string>
#include <string_view>

#include <mlx/primitives.h>

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

template <typename T>
std::vector<int64_t> copy_of(const mx::array& a) {
  const T* p = a.data<T>();
  return std::vector<int64_t>(p, p + a.size());
}

}  // namespace

std::optional<std::vector<int64_t>> known_ints(const mx::array& a) {
  // status() rather than is_available(): the latter waits on an in-flight evaluation.
  if (a.status() != mx::array::Status::available || a.size() == 0 || !a.flags().row_contiguous) {
    return std::nullopt;
  }
  if (a.dtype() == mx::int64) return copy_of<int64_t>(a);
  if (a.dtype() == mx::int32) return copy_of<int32_t>(a);
  return std::nullopt;
}

std::optional<int64_t> known_max(const mx::array& a) {
  const auto v = known_ints(a);
  if (!v) return std::nullopt;
  return *std::max_element(v->begin(), v->end());
}

bool is_view(const mx::array& a) {
  if (a.status() == mx::array::Status::available || !a.has_primitive() || a.inputs().size() != 1) return false;
  const std::string_view kind = a.primitive().name();
  return kind == "Broadcast" || kind == "Reshape" || kind == "ExpandDims" || kind == "Squeeze";
}

std::optional<bool> known_uniform_bool(const mx::array& a) {
  if (a.dtype() != mx::bool_ || a.size() == 0) return std::nullopt;
  if (is_view(a)) return known_uniform_bool(a.inputs()[0]);
  // Small arrays only: a materialised mask of a sequence's positions is not worth reading every call.
  constexpr size_t kMostElements = 4096;
  if (a.status() != mx::array::Status::available || !a.flags().row_contiguous || a.size() > kMostElements)
    return std::nullopt;
  const bool* p = a.data<bool>();
  if (!std::all_of(p, p + a.size(), [&](bool v) { return v == p[0]; })) return std::nullopt;
  return p[0];
}

namespace {

// A selection of its first input's elements (a gather by indices, a slice, a copy): none it lacks.
bool selects(const mx::array& a) {
  if (a.status() == mx::array::Status::available || !a.has_primitive() || a.inputs().empty()) return false;
  const std::string_view kind = a.primitive().name();
  return kind == "Gather" || kind == "GatherAxis" || kind == "Slice" || kind == "Copy" || kind == "Contiguous";
}

}  // namespace

bool known_none_positive(const mx::array& a) {
  if (a.dtype() != mx::float32 || a.size() == 0) return false;
  // A draft-verifying program spreads each row's temperature over its verified positions with a gather
  // (sampler/draft_verification.py _spread): every element it yields is one of the input's.
  if (selects(a)) return known_none_positive(a.inputs()[0]);
  // Views that only repeat or regroup elements (the exporter broadcasts a [B] temperature input to its
  // rows) have no element their input lacks: look through them to the input the host holds.
  if (is_view(a)) return known_none_positive(a.inputs()[0]);
  if (a.status() != mx::array::Status::available && a.has_primitive() && a.inputs().size() == 1) return false;
  if (a.status() != mx::array::Status::available || !a.flags().row_contiguous) return false;
  const float* p = a.data<float>();
  return std::none_of(p, p + a.size(), [](float t) { return t > 0.0f; });
}

}  // namespace etmlx::kernels
