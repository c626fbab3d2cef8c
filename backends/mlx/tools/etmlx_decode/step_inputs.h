// The inputs of one decoder call, laid out by input name in the program's
// order (backends/mlx/llm/decoder/export.py). Every input past the model's
// (tokens, start_pos, lengths) is a knob of the metadata's list (knobs.h):
// it gets the value given on the command line, else its off value (its
// "first" value on a sequence's first call, e.g. penalty_reset).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <executorch/extension/tensor/tensor_ptr.h>
#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/executor/method_meta.h>

#include "decode_rows.h"
#include "knobs.h"
#include "decoder_meta.h"
#include "prompt_images.h"

namespace etmlx {

class StepInputs {
 public:
  // Matches `names` (the metadata's input names) against the method's inputs (count, dtypes, shapes). `values` holds
  // every spec's value by name (resolve_knob_flags); one the program lacks is
  // an error unless it is off.
  static std::optional<StepInputs> plan(const executorch::runtime::MethodMeta& meta,
                                        const std::vector<std::string>& names,
                                        const std::vector<KnobSpec>& specs,
                                        const std::map<std::string, KnobValue>& values,
                                        std::string* error);

  // plan() with every knob at its default (greedy, no filters) and the verify input as the program's metadata
  // says (set_verify): what etmlx_bench and a draft model (model_draft.h) run. The error of a metadata that
  // disagrees with the program starts "its metadata".
  static std::optional<StepInputs> plan_defaults(const executorch::runtime::MethodMeta& meta, const DecoderMeta& decoder,
                                                 std::string* error);

  // Every sequence row runs switchable adapter `index` (1-based; 0 = the base model): false, with `error`, for a
  // program without the `adapter` input.
  bool set_adapter(int64_t index, std::string* error);

  // Row 0's image embeddings at their prompt positions (a vision-language program's image_embeds input; other
  // positions, rows and calls get zeros, which the program does not read). The object must outlive the calls.
  // False, with `error` saying what the metadata says, when the program has no image_embeds input or one of
  // another width than the embeddings': program and metadata come from different exports.
  bool set_images(const PromptImages* images, std::string* error);

  // Rows per call (the program's batch).
  int64_t batch() const { return batch_; }

  // Longest `tokens` one call accepts (the upper bound of its length axis).
  int64_t max_call_length() const { return max_call_length_; }

  // The call's inputs for the rows the decode-step rules laid out (decode_rows.h): a row of kind Request
  // samples with `temperature` and the command line's knobs (their "first" values on its step 0), the
  // others greedy with every knob off. The returned values borrow tensors held by this object until the
  // next build(). `mask_row` (optional): row 0's allowed_mask words (the other rows stay all ones).
  std::vector<executorch::runtime::EValue> build(const CallLayout& call, float temperature,
                                                 const std::vector<int32_t>* mask_row = nullptr);

  // Words per row of the program's allowed_mask input, or 0 when it has none.
  int64_t mask_words() const;

  // The metadata's draft_tokens K (0: a plain program) and the fewest verify columns a call carries
  // (DecoderMeta's draft_tokens and verify_min_width; llm/decoder/step_inputs.py verify_input lays the input out
  // the same way). False, with `error` saying what the metadata says, when the program's "verify" input
  // disagrees with K: program and metadata come from different exports.
  bool set_verify(int64_t draft_tokens, int64_t min_width, std::string* error);

 private:
  enum class Role { Tokens, StartPos, Lengths, Verify, Deliver, Temperature, Seed, Knob, ImageEmbeds, RopePositions };
  struct Slot {
    std::string name;
    Role role;
    executorch::aten::ScalarType dtype;
    std::vector<int32_t> sizes;  // static shape (per-row and knob inputs)
    KnobValue value;             // Knob only: row 0's value
    KnobValue first;             // Knob only: row 0's value on a sequence's first call
    KnobValue idle;              // Knob only: the idle rows' value (a fresh sequence, feature off)
  };

  // values[b] in row b's elements.
  executorch::extension::TensorPtr filled(const Slot& slot, const std::vector<KnobValue>& values) const;

  bool verifies() const;  // the program has the "verify" input

  std::vector<Slot> slots_;
  int64_t max_call_length_ = 0;
  int64_t batch_ = 1;
  int64_t draft_tokens_ = 0, verify_min_width_ = 2;
  std::vector<executorch::extension::TensorPtr> alive_;
  const PromptImages* images_ = nullptr;
};

}  // namespace etmlx
