// --choice-ids: the output is one of a few token-id sequences, masked on the device step by step.
//
// The allowed tokens after `generated` are the next ids of every choice that `generated` is a prefix
// of, plus the stop ids once `generated` is a whole choice. It works in the id space (no tokenizer,
// no grammar engine): a choice is the exact sequence given, not every tokenization of its text.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace etmlx {

class ChoiceMask {
 public:
  // "1,2,3;4,5" -> two choices. Empty choices, ids outside [0, vocab) and duplicate choices are errors.
  static bool parse(const std::string& text, int64_t vocab, std::vector<std::vector<int64_t>>* choices,
                    std::string* error);

  ChoiceMask(std::vector<std::vector<int64_t>> choices, std::vector<int64_t> eos, int64_t vocab);

  // The packed row (ceil(V/32) words, bit j of word i = token 32 i + j) for the step after `generated`.
  std::vector<int32_t> row(const std::vector<int64_t>& generated) const;

  // `generated` is a whole choice that no other choice extends: nothing but a stop may follow.
  bool finished(const std::vector<int64_t>& generated) const;

 private:
  bool is_prefix(const std::vector<int64_t>& choice, const std::vector<int64_t>& generated) const;

  std::vector<std::vector<int64_t>> choices_;
  std::vector<int64_t> eos_;
  int64_t vocab_;
};

}  // namespace etmlx
