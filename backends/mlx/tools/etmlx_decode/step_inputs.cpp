#include "step_inputs.h"

#include <algorithm>

namespace etmlx {

using executorch::aten::ScalarType;
using executorch::extension::make_tensor_ptr;
using executorch::extension::TensorPtr;
using executorch::runtime::EValue;
using executorch::runtime::MethodMeta;
using executorch::runtime::Tag;

namespace {

struct KnobOff {
  const char* name;
  double off;
};

// The values that switch each sampler feature off (sampler_config.py). A
// bias id of -1 lies outside the vocabulary, so the device ignores the pair.
constexpr KnobOff kKnobs[] = {
    {"top_k", 0},           {"top_p", 1},          {"min_p", 0},
    {"bias_ids", -1},       {"bias_values", 0},    {"presence_penalty", 0},
    {"frequency_penalty", 0}, {"repetition_penalty", 1}, {"penalty_add", -1},
};

bool supported_fill_type(ScalarType t) {
  return t == ScalarType::Long || t == ScalarType::Int || t == ScalarType::Float ||
         t == ScalarType::Double;
}

}  // namespace

std::optional<StepInputs> StepInputs::plan(const MethodMeta& meta,
                                           const std::optional<std::vector<std::string>>& names,
                                           const std::map<std::string, double>& knobs,
                                           std::string* error) {
  const size_t n = meta.num_inputs();
  std::vector<std::string> order;
  if (names) {
    order = *names;
  } else if (n == 5) {
    order = {"tokens", "start_pos", "lengths", "temperature", "seed"};
  } else if (n == 4) {
    order = {"tokens", "start_pos", "lengths", "temperature"};  // unseeded
  } else {
    *error = "the program has " + std::to_string(n) +
             " inputs; without FILE.pte.json's \"inputs\" only the plain decoder "
             "(tokens, start_pos, lengths, temperature[, seed]) is understood";
    return std::nullopt;
  }
  if (order.size() != n) {
    *error = "its .json lists " + std::to_string(order.size()) + " inputs but the program has " +
             std::to_string(n);
    return std::nullopt;
  }

  StepInputs plan;
  // Rows per call, from `tokens` [B, L]; every per-row input is then [B].
  for (size_t i = 0; i < n; ++i) {
    const auto info = meta.input_tensor_meta(i);
    if (order[i] == "tokens" && info.ok() && info->sizes().size() == 2 && info->sizes()[0] >= 1)
      plan.batch_ = info->sizes()[0];
  }
  std::map<std::string, double> unused = knobs;
  for (size_t i = 0; i < n; ++i) {
    const std::string& name = order[i];
    const auto tag = meta.input_tag(i);
    if (!tag.ok() || tag.get() != Tag::Tensor) {
      *error = "input " + std::to_string(i) + " (" + name + ") is not a tensor";
      return std::nullopt;
    }
    const auto info = meta.input_tensor_meta(i);
    if (!info.ok()) {
      *error = "input " + std::to_string(i) + " (" + name + ") has no tensor metadata";
      return std::nullopt;
    }
    Slot slot;
    slot.name = name;
    slot.dtype = info->scalar_type();
    slot.sizes.assign(info->sizes().begin(), info->sizes().end());
    const auto expect = [&](ScalarType dtype, const char* dtype_name) {
      if (slot.dtype == dtype) return true;
      *error = "input '" + name + "' must be " + dtype_name;
      return false;
    };
    const auto per_row = [&]() {
      // One value per row (a scalar also does at batch 1).
      if ((slot.sizes.empty() && plan.batch_ == 1) || (slot.sizes.size() == 1 && slot.sizes[0] == plan.batch_))
        return true;
      *error = "input '" + name + "' must be [" + std::to_string(plan.batch_) + "] (one value per row)";
      return false;
    };
    if (name == "tokens") {
      slot.role = Role::Tokens;
      if (!expect(ScalarType::Long, "int64")) return std::nullopt;
      if (slot.sizes.size() != 2 || slot.sizes[0] < 1 || slot.sizes[1] < 1) {
        *error = "input 'tokens' must be [B, L]";
        return std::nullopt;
      }
      plan.max_call_length_ = slot.sizes[1];
    } else if (name == "start_pos" || name == "lengths") {
      slot.role = name == "start_pos" ? Role::StartPos : Role::Lengths;
      if (!expect(ScalarType::Long, "int64") || !per_row()) return std::nullopt;
    } else if (name == "temperature") {
      slot.role = Role::Temperature;
      if (!expect(ScalarType::Float, "float32") || !per_row()) return std::nullopt;
    } else if (name == "seed") {
      slot.role = Role::Seed;
      if (!expect(ScalarType::Long, "int64") || !per_row()) return std::nullopt;
    } else if (name == "penalty_reset") {
      slot.role = Role::PenaltyReset;
    } else {
      const KnobOff* knob = nullptr;
      for (const auto& k : kKnobs)
        if (name == k.name) knob = &k;
      if (!knob) {
        *error = "input '" + name + "' is not one etmlx_decode knows how to fill";
        return std::nullopt;
      }
      slot.role = Role::Knob;
      slot.value = slot.off = knob->off;
      if (const auto given = unused.find(name); given != unused.end()) {
        slot.value = given->second;
        unused.erase(given);
      }
    }
    if ((slot.role == Role::Knob || slot.role == Role::PenaltyReset) && !supported_fill_type(slot.dtype)) {
      *error = "input '" + name + "' has a dtype etmlx_decode cannot fill";
      return std::nullopt;
    }
    plan.slots_.push_back(std::move(slot));
  }
  if (plan.max_call_length_ == 0) {
    *error = "the program has no 'tokens' input";
    return std::nullopt;
  }
  for (const auto& [name, value] : unused) {
    // Asking for a feature the program cannot apply would silently sample
    // something else; its off value is harmless.
    for (const auto& k : kKnobs) {
      if (name == k.name && value != k.off) {
        *error = "the program was exported without " + name + " (see `etmlx export --sampler`)";
        return std::nullopt;
      }
    }
  }
  return plan;
}

namespace {

// `count` values: the first `head` are `row0`, the rest `rest`.
template <typename T>
std::vector<T> rows(size_t count, size_t head, double row0, double rest) {
  std::vector<T> out(count, static_cast<T>(rest));
  std::fill(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(std::min(head, count)), static_cast<T>(row0));
  return out;
}

}  // namespace

TensorPtr StepInputs::filled(const Slot& slot, double row0, double rest) const {
  int64_t numel = 1;
  for (int32_t s : slot.sizes) numel *= s;
  const size_t count = static_cast<size_t>(numel);
  const size_t head = count / static_cast<size_t>(batch_);  // row 0's elements (all of them at batch 1)
  std::vector<int32_t> sizes(slot.sizes.begin(), slot.sizes.end());
  switch (slot.dtype) {
    case ScalarType::Long:
      return make_tensor_ptr(sizes, rows<int64_t>(count, head, row0, rest));
    case ScalarType::Int:
      return make_tensor_ptr(sizes, rows<int32_t>(count, head, row0, rest));
    case ScalarType::Double:
      return make_tensor_ptr(sizes, rows<double>(count, head, row0, rest));
    default:  // Float; plan() admitted nothing else
      return make_tensor_ptr(sizes, rows<float>(count, head, row0, rest));
  }
}

std::vector<EValue> StepInputs::build(const std::vector<int64_t>& tokens, int64_t start_pos,
                                      float temperature, int64_t seed, bool first) {
  const auto length = static_cast<int32_t>(tokens.size());
  alive_.clear();
  std::vector<EValue> values;
  for (const Slot& slot : slots_) {
    TensorPtr t;
    switch (slot.role) {
      case Role::Tokens: {
        // Row 0 is the sequence; the idle rows are padding (their length is 1).
        std::vector<int64_t> padded(static_cast<size_t>(batch_) * tokens.size(), 0);
        std::copy(tokens.begin(), tokens.end(), padded.begin());
        t = make_tensor_ptr({static_cast<int32_t>(batch_), length}, std::move(padded));
        break;
      }
      case Role::StartPos: {
        std::vector<int64_t> v(static_cast<size_t>(batch_), 0);
        v[0] = start_pos;
        t = make_tensor_ptr(slot.sizes, std::move(v));
        break;
      }
      case Role::Lengths:
        t = make_tensor_ptr(slot.sizes, rows<int64_t>(static_cast<size_t>(batch_), 1, length, 1));
        break;
      case Role::Temperature:
        t = make_tensor_ptr(slot.sizes, rows<float>(static_cast<size_t>(batch_), 1, temperature, 0));
        break;
      case Role::Seed: {
        std::vector<int64_t> v(static_cast<size_t>(batch_), 0);
        v[0] = seed;  // not through a double: 64-bit seeds stay exact
        t = make_tensor_ptr(slot.sizes, std::move(v));
        break;
      }
      case Role::PenaltyReset:
        // A new sequence starts with no counted tokens; idle rows never count any.
        t = filled(slot, first ? 1 : 0, 1);
        break;
      case Role::Knob:
        t = filled(slot, slot.value, slot.off);
        break;
    }
    alive_.push_back(t);
    values.emplace_back(*t);
  }
  return values;
}

}  // namespace etmlx
