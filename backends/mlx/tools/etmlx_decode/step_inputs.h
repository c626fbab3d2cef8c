// The inputs of one decoder call, laid out by input name in the program's
// order (backends/mlx/llm/decoder/export.py). Sampler knobs get the values
// given on the command line, the others their "off" values
// (backends/mlx/llm/sampler/config.py); logit bias and penalty seeding are
// always off.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <executorch/extension/tensor/tensor_ptr.h>
#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/executor/method_meta.h>

namespace etmlx {

class StepInputs {
 public:
  // Matches `names` against the method's inputs (count, dtypes, shapes).
  // Without names, the plain decoder (no knobs) is assumed. `knobs` holds
  // values by input name; one the program lacks is an error unless it is off.
  static std::optional<StepInputs> plan(const executorch::runtime::MethodMeta& meta,
                                        const std::optional<std::vector<std::string>>& names,
                                        const std::map<std::string, double>& knobs,
                                        std::string* error);

  // Longest `tokens` one call accepts (the upper bound of its length axis).
  int64_t max_call_length() const { return max_call_length_; }
  // Rows per call (the program's batch). The sequence is row 0; the others
  // idle: one token at position 0, greedy, knobs off, output ignored.
  int64_t batch() const { return batch_; }

  // The call's inputs: `tokens` at cache positions start_pos.., sampled with
  // (temperature, seed); `first` marks the start of a sequence. The returned
  // values borrow tensors held by this object until the next build().
  std::vector<executorch::runtime::EValue> build(const std::vector<int64_t>& tokens,
                                                 int64_t start_pos, float temperature,
                                                 int64_t seed, bool first);

 private:
  enum class Role { Tokens, StartPos, Lengths, Temperature, Seed, Knob, PenaltyReset };
  struct Slot {
    std::string name;
    Role role;
    executorch::aten::ScalarType dtype;
    std::vector<int32_t> sizes;  // static shape (per-row and knob inputs)
    double value = 0;            // Knob only: row 0's value
    double off = 0;              // Knob only: the idle rows' value
  };

  // `row0` in row 0's elements, `rest` in the idle rows'.
  executorch::extension::TensorPtr filled(const Slot& slot, double row0, double rest) const;

  std::vector<Slot> slots_;
  int64_t max_call_length_ = 0;
  int64_t batch_ = 1;
  std::vector<executorch::extension::TensorPtr> alive_;
};

}  // namespace etmlx
