#include "step_inputs.h"


namespace etmlx {

using executorch::aten::ScalarType;
using executorch::extension::make_tensor_ptr;
using executorch::extension::TensorPtr;
using executorch::runtime::EValue;
using executorch::runtime::MethodMeta;
using executorch::runtime::Tag;

namespace {

bool supported_fill_type(ScalarType t) {
  return t == ScalarType::Long || t == ScalarType::Int || t == ScalarType::Float ||
         t == ScalarType::Double;
}

}  // namespace

std::optional<StepInputs> StepInputs::plan(const MethodMeta& meta,
                                           const std::optional<std::vector<std::string>>& names,
                                           const std::vector<KnobSpec>& specs,
                                           const std::map<std::string, KnobValue>& values,
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

  const auto spec_named = [&](const std::string& name) -> const KnobSpec* {
    for (const KnobSpec& k : specs)
      if (k.name == name) return &k;
    return nullptr;
  };
  const auto value_of = [&](const KnobSpec& spec) {
    const auto v = values.find(spec.name);
    return v == values.end() ? spec.off : v->second;
  };
  StepInputs plan;
  std::vector<std::string> used;
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
    } else {
      const KnobSpec* spec = spec_named(name);
      if (!spec) {
        *error = "input '" + name + "' is not one etmlx_decode knows how to fill (" +
                 (&specs == &builtin_knobs() ? "FILE.pte.json lists no \"knobs\": re-export it with this etmlx)"
                                             : "FILE.pte.json's \"knobs\" has no entry for it)");
        return std::nullopt;
      }
      used.push_back(name);
      if (name == "temperature") {  // the loop's own per-call values (seed: + step)
        slot.role = Role::Temperature;
        if (!expect(ScalarType::Float, "float32") || !per_row()) return std::nullopt;
      } else if (name == "seed") {
        slot.role = Role::Seed;
        if (!expect(ScalarType::Long, "int64") || !per_row()) return std::nullopt;
      } else {
        slot.role = Role::Knob;
        slot.value = value_of(*spec);
        slot.first = spec->first.value_or(slot.value);
        const bool int_input = slot.dtype == ScalarType::Long || slot.dtype == ScalarType::Int;
        if (!supported_fill_type(slot.dtype) || int_input != spec->integer) {
          *error = "input '" + name + "' has a dtype etmlx_decode cannot fill (FILE.pte.json says " +
                   (spec->integer ? "int64" : "float32") + ")";
          return std::nullopt;
        }
      }
    }
    plan.slots_.push_back(std::move(slot));
  }
  if (plan.max_call_length_ == 0) {
    *error = "the program has no 'tokens' input";
    return std::nullopt;
  }
  for (const KnobSpec& spec : specs) {
    // Asking for a feature the program cannot apply would silently sample
    // something else; its off value is harmless. Knobs every program has
    // (no export hint: temperature, seed) are left to the loop.
    bool present = false;
    for (const std::string& u : used) present = present || u == spec.name;
    if (!present && !spec.export_hint.empty() && !is_off(spec, value_of(spec))) {
      *error = "the program was exported without " + spec.name + " (" + spec.export_hint + ")";
      return std::nullopt;
    }
  }
  return plan;
}

TensorPtr StepInputs::filled(const Slot& slot, const KnobValue& value) const {
  int64_t numel = 1;
  for (int32_t s : slot.sizes) numel *= s;
  const size_t count = static_cast<size_t>(numel);
  std::vector<int32_t> sizes(slot.sizes.begin(), slot.sizes.end());
  switch (slot.dtype) {
    case ScalarType::Long:
      return make_tensor_ptr(sizes, std::vector<int64_t>(count, value.i));
    case ScalarType::Int:
      return make_tensor_ptr(sizes, std::vector<int32_t>(count, static_cast<int32_t>(value.i)));
    case ScalarType::Double:
      return make_tensor_ptr(sizes, std::vector<double>(count, value.f));
    default:  // Float; plan() admitted nothing else
      return make_tensor_ptr(sizes, std::vector<float>(count, static_cast<float>(value.f)));
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
      case Role::Knob:
        t = filled(slot, first ? slot.first : slot.value);
        break;
    }
    alive_.push_back(t);
    values.emplace_back(*t);
  }
  return values;
}

}  // namespace etmlx
