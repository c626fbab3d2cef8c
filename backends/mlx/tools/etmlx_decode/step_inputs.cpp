#include "step_inputs.h"


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
      // A scalar, or one value for the single row this program decodes.
      if (slot.sizes.empty() || (slot.sizes.size() == 1 && slot.sizes[0] == 1)) return true;
      *error = "input '" + name + "' must be a scalar or [1] (batch 1)";
      return false;
    };
    if (name == "tokens") {
      slot.role = Role::Tokens;
      if (!expect(ScalarType::Long, "int64")) return std::nullopt;
      if (slot.sizes.size() != 2 || slot.sizes[0] != 1 || slot.sizes[1] < 1) {
        *error = "input 'tokens' must be [1, L]: etmlx_decode runs programs exported with batch 1";
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
      slot.value = knob->off;
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

TensorPtr StepInputs::filled(const Slot& slot, double value) const {
  int64_t numel = 1;
  for (int32_t s : slot.sizes) numel *= s;
  const size_t count = static_cast<size_t>(numel);
  std::vector<int32_t> sizes(slot.sizes.begin(), slot.sizes.end());
  switch (slot.dtype) {
    case ScalarType::Long:
      return make_tensor_ptr(sizes, std::vector<int64_t>(count, static_cast<int64_t>(value)));
    case ScalarType::Int:
      return make_tensor_ptr(sizes, std::vector<int32_t>(count, static_cast<int32_t>(value)));
    case ScalarType::Double:
      return make_tensor_ptr(sizes, std::vector<double>(count, value));
    default:  // Float; plan() admitted nothing else
      return make_tensor_ptr(sizes, std::vector<float>(count, static_cast<float>(value)));
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
      case Role::Tokens:
        t = make_tensor_ptr({1, length}, std::vector<int64_t>(tokens));
        break;
      case Role::StartPos:
        t = make_tensor_ptr(slot.sizes, std::vector<int64_t>{start_pos});
        break;
      case Role::Lengths:
        t = make_tensor_ptr(slot.sizes, std::vector<int64_t>{length});
        break;
      case Role::Temperature:
        t = make_tensor_ptr(slot.sizes, std::vector<float>{temperature});
        break;
      case Role::Seed:
        t = make_tensor_ptr(slot.sizes, std::vector<int64_t>{seed});
        break;
      case Role::PenaltyReset:
        // A new sequence starts with no counted tokens.
        t = filled(slot, first ? 1 : 0);
        break;
      case Role::Knob:
        t = filled(slot, slot.value);
        break;
    }
    alive_.push_back(t);
    values.emplace_back(*t);
  }
  return values;
}

}  // namespace etmlx
