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

bool supported_fill_type(ScalarType t) {
  return t == ScalarType::Long || t == ScalarType::Int || t == ScalarType::Float ||
         t == ScalarType::Double;
}

}  // namespace

std::optional<StepInputs> StepInputs::plan(const MethodMeta& meta,
                                           const std::vector<std::string>& names,
                                           const std::vector<KnobSpec>& specs,
                                           const std::map<std::string, KnobValue>& values,
                                           std::string* error) {
  const size_t n = meta.num_inputs();
  const std::vector<std::string>& order = names;
  if (order.size() != n) {
    *error = "its metadata lists " + std::to_string(order.size()) + " inputs but the program has " +
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
  // Rows per call, from `tokens` [B, L]; every per-row input is then [B].
  for (size_t i = 0; i < n; ++i) {
    const auto info = meta.input_tensor_meta(i);
    if (order[i] == "tokens" && info.ok() && info->sizes().size() == 2 && info->sizes()[0] >= 1)
      plan.batch_ = info->sizes()[0];
  }
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
    } else if (name == "verify") {  // meta.py DRAFT_INPUT: [B, G], G up to K + 1
      slot.role = Role::Verify;
      if (!expect(ScalarType::Long, "int64")) return std::nullopt;
      if (slot.sizes.size() != 2 || slot.sizes[0] != plan.batch_) {
        *error = "input 'verify' must be [" + std::to_string(plan.batch_) + ", G]";
        return std::nullopt;
      }
    } else if (name == "deliver") {  // meta.py DELIVER_INPUT: a pipelined draft program's, [B] bool
      slot.role = Role::Deliver;
      if (!expect(ScalarType::Bool, "bool") || !per_row()) return std::nullopt;
    } else if (name == "adapter") {  // meta.py ADAPTER_INPUT: switchable LoRA adapters, [B]; 0 = the base model
      slot.role = Role::Knob;  // 0 (the base model) unless set_adapter() picks one for the sequence's rows
      if (!expect(ScalarType::Long, "int64") || !per_row()) return std::nullopt;
    } else if (name == "image_embeds") {  // meta.py IMAGE_INPUT: [B, L, D] float32, read at image positions
      slot.role = Role::ImageEmbeds;
      if (!expect(ScalarType::Float, "float32")) return std::nullopt;
      if (slot.sizes.size() != 3 || slot.sizes[0] != plan.batch_) {
        *error = "input 'image_embeds' must be [" + std::to_string(plan.batch_) + ", L, D]";
        return std::nullopt;
      }
    } else if (name == "rope_positions") {  // meta.py ROPE_INPUT (multimodal RoPE): [B, L, 3] int64
      slot.role = Role::RopePositions;
      if (!expect(ScalarType::Long, "int64")) return std::nullopt;
      if (slot.sizes.size() != 3 || slot.sizes[0] != plan.batch_ || slot.sizes[2] != 3) {
        *error = "input 'rope_positions' must be [" + std::to_string(plan.batch_) + ", L, 3]";
        return std::nullopt;
      }
    } else if (name == "start_pos" || name == "lengths") {
      slot.role = name == "start_pos" ? Role::StartPos : Role::Lengths;
      if (!expect(ScalarType::Long, "int64") || !per_row()) return std::nullopt;
    } else {
      const KnobSpec* spec = spec_named(name);
      if (!spec) {
        *error = "input '" + name + "' is not one etmlx_decode knows how to fill (its metadata's \"knobs\" has no "
                 "entry for it)";
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
        slot.idle = spec->first.value_or(spec->off);
        const bool int_input = slot.dtype == ScalarType::Long || slot.dtype == ScalarType::Int;
        if (!supported_fill_type(slot.dtype) || int_input != spec->integer) {
          *error = "input '" + name + "' has a dtype etmlx_decode cannot fill (its metadata says " +
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

TensorPtr StepInputs::filled(const Slot& slot, const std::vector<KnobValue>& values) const {
  int64_t numel = 1;
  for (int32_t s : slot.sizes) numel *= s;
  const auto count = static_cast<size_t>(numel);
  // A row's elements (all of them at batch 1): plan() admitted only [B], [B, N] and a scalar at batch 1.
  const size_t per_row = std::max<size_t>(count / static_cast<size_t>(batch_), 1);
  std::vector<int32_t> sizes(slot.sizes.begin(), slot.sizes.end());
  const auto fill = [&](auto zero, auto get) {
    std::vector<decltype(zero)> out(count);
    for (size_t i = 0; i < count; ++i) out[i] = get(values[i / per_row]);
    return make_tensor_ptr(sizes, std::move(out));
  };
  switch (slot.dtype) {
    case ScalarType::Long:
      return fill(int64_t{0}, [](const KnobValue& v) { return v.i; });
    case ScalarType::Int:
      return fill(int32_t{0}, [](const KnobValue& v) { return static_cast<int32_t>(v.i); });
    case ScalarType::Double:
      return fill(double{0}, [](const KnobValue& v) { return v.f; });
    default:  // Float; plan() admitted nothing else
      return fill(float{0}, [](const KnobValue& v) { return static_cast<float>(v.f); });
  }
}

bool StepInputs::verifies() const {
  for (const Slot& slot : slots_)
    if (slot.role == Role::Verify) return true;
  return false;
}

std::optional<StepInputs> StepInputs::plan_defaults(const MethodMeta& meta, const DecoderMeta& decoder,
                                                    std::string* error) {
  std::map<std::string, KnobValue> knobs;
  if (!resolve_knob_flags(decoder.knobs, {}, "", &knobs, error)) return std::nullopt;
  auto inputs = plan(meta, decoder.inputs, decoder.knobs, knobs, error);
  if (inputs && !inputs->set_verify(decoder.draft_tokens, decoder.verify_min_width, error)) {
    *error = "its metadata " + *error;
    return std::nullopt;
  }
  return inputs;
}

bool StepInputs::set_verify(int64_t draft_tokens, int64_t min_width, std::string* error) {
  if (verifies() != (draft_tokens > 0)) {
    *error = (draft_tokens > 0 ? "says draft_tokens " + std::to_string(draft_tokens) +
                                     " but the program has no 'verify' input"
                               : std::string("says nothing of draft_tokens but the program has a 'verify' input")) +
             ": they come from different exports";
    return false;
  }
  draft_tokens_ = draft_tokens;
  verify_min_width_ = min_width;
  return true;
}

int64_t StepInputs::mask_words() const {
  for (const Slot& slot : slots_) {
    // [B, words], or [B, G, words] in a draft-verifying program (a mask per verified position)
    if (slot.role == Role::Knob && slot.name == "allowed_mask" && slot.dtype == ScalarType::Int &&
        (slot.sizes.size() == 2 || slot.sizes.size() == 3))
      return slot.sizes.back();
  }
  return 0;
}

bool StepInputs::set_images(const PromptImages* images, std::string* error) {
  for (const Slot& slot : slots_) {
    if (slot.role != Role::ImageEmbeds) continue;
    if (slot.sizes[2] != images->dim) {
      *error = "says image_embed_dim " + std::to_string(images->dim) + " but the program's image_embeds input is " +
               std::to_string(slot.sizes[2]) + " wide: they come from different exports";
      return false;
    }
    images_ = images;
    return true;
  }
  *error = "says the program takes images but it has no image_embeds input: they come from different exports";
  return false;
}

bool StepInputs::set_adapter(int64_t index, std::string* error) {
  for (Slot& slot : slots_) {
    if (slot.name != "adapter") continue;
    slot.value.i = slot.first.i = index;  // idle rows keep 0: their tokens are thrown away
    return true;
  }
  *error = "the program has no switchable adapters (export with --adapters NAME=DIR,...)";
  return false;
}

std::vector<EValue> StepInputs::build(const CallLayout& call, float temperature, const std::vector<int32_t>* mask_row) {
  const auto batch = static_cast<size_t>(batch_);
  const auto sequence = [&](size_t row) { return call.kinds[row] == RowKind::Request; };
  alive_.clear();
  std::vector<EValue> values;
  // The verify input's width G: one more than row 0's drafts (at least the program's fewest) at batch 1, else K + 1.
  int64_t width = draft_tokens_ + 1;
  if (batch_ == 1 && !call.drafts.empty())
    width = std::max<int64_t>(verify_min_width_, 1 + static_cast<int64_t>(call.drafts[0].size()));
  for (const Slot& slot : slots_) {
    TensorPtr t;
    switch (slot.role) {
      case Role::Tokens:
        t = make_tensor_ptr({static_cast<int32_t>(batch_), static_cast<int32_t>(call.width)}, call.tokens);
        break;
      case Role::StartPos:
        t = make_tensor_ptr(slot.sizes, call.start_pos);
        break;
      case Role::Lengths:
        t = make_tensor_ptr(slot.sizes, call.lengths);
        break;
      case Role::Verify: {
        // Per row: its last accepted token (the one before its drafts), its drafts, -1 padding. A one-row
        // program's G is one more than the row's drafts (at least the program's fewest); a batched one's K + 1.
        std::vector<int64_t> verify(batch * static_cast<size_t>(width), -1);
        for (size_t b = 0; b < batch; ++b) {
          const auto& drafts = call.drafts[b];
          const int64_t before = call.lengths[b] - 1 - static_cast<int64_t>(drafts.size());
          int64_t* row = verify.data() + b * static_cast<size_t>(width);
          row[0] = before >= 0 ? call.tokens[b * static_cast<size_t>(call.width) + static_cast<size_t>(before)] : 0;
          std::copy(drafts.begin(), drafts.end(), row + 1);
        }
        t = make_tensor_ptr({static_cast<int32_t>(batch_), static_cast<int32_t>(width)}, std::move(verify));
        break;
      }
      case Role::Deliver:  // the call returns its own outputs (decode_rows.h), in every row
        t = make_tensor_ptr(slot.sizes, std::vector<uint8_t>(batch, call.deliver ? 1 : 0), ScalarType::Bool);
        break;
      case Role::Temperature: {
        std::vector<float> per_row(batch);
        for (size_t b = 0; b < batch; ++b) per_row[b] = sequence(b) ? temperature : 0.0f;
        t = make_tensor_ptr(slot.sizes, std::move(per_row));
        break;
      }
      case Role::ImageEmbeds: {
        const int64_t dim = slot.sizes[2];
        std::vector<float> embeds(batch * static_cast<size_t>(call.width * dim), 0.0f);
        if (images_ != nullptr) {  // row 0 comes first (set_images checked the width)
          const int64_t start = call.start_pos[0];
          for (size_t i = 0; i < images_->positions.size(); ++i) {
            const int64_t column = images_->positions[i] - start;
            if (column < 0 || column >= call.width) continue;
            std::copy_n(images_->embeds.data() + i * static_cast<size_t>(dim), dim,
                        embeds.data() + static_cast<size_t>(column * dim));
          }
        }
        t = make_tensor_ptr({static_cast<int32_t>(batch_), static_cast<int32_t>(call.width), static_cast<int32_t>(dim)},
                            std::move(embeds));
        break;
      }
      case Role::RopePositions: {  // text positions: each token's cache position on all three axes
        std::vector<int64_t> positions(batch * static_cast<size_t>(call.width) * 3);
        for (size_t b = 0; b < batch; ++b)
          for (int64_t i = 0; i < call.width; ++i)
            for (size_t a = 0; a < 3; ++a)
              positions[(b * static_cast<size_t>(call.width) + static_cast<size_t>(i)) * 3 + a] = call.start_pos[b] + i;
        t = make_tensor_ptr({static_cast<int32_t>(batch_), static_cast<int32_t>(call.width), 3}, std::move(positions));
        break;
      }
      case Role::Seed:  // int64 all the way: 64-bit seeds stay exact
        t = make_tensor_ptr(slot.sizes, call.seeds);
        break;
      case Role::Knob: {
        std::vector<KnobValue> per_row(batch);
        for (size_t b = 0; b < batch; ++b)
          per_row[b] = !sequence(b) ? slot.idle : call.first[b] ? slot.first : slot.value;
        if (slot.sizes.size() == 3 && draft_tokens_ > 0) {  // a mask per verified position: [B, G, words]
          Slot wide = slot;
          wide.sizes[1] = static_cast<int32_t>(width);
          t = filled(wide, per_row);
        } else {
          t = filled(slot, per_row);
        }
        if (mask_row != nullptr && slot.name == "allowed_mask" && slot.dtype == ScalarType::Int &&
            static_cast<int64_t>(mask_row->size()) == mask_words()) {
          std::copy(mask_row->begin(), mask_row->end(), t->mutable_data_ptr<int32_t>());  // row 0 comes first
        }
        break;
      }
    }
    alive_.push_back(t);
    values.emplace_back(*t);
  }
  return values;
}

}  // namespace etmlx
