#include "choice_mask.h"

#include <algorithm>
#include <sstream>

#include "decode_args.h"

namespace etmlx {

bool ChoiceMask::parse(const std::string& text, int64_t vocab, std::vector<std::vector<int64_t>>* choices,
                       std::string* error) {
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ';')) {
    std::vector<int64_t> ids;
    if (!parse_id_list(item, "--choice-ids", &ids, error)) return false;
    for (int64_t id : ids) {
      if (id < 0 || id >= vocab) {
        *error = "--choice-ids: token id " + std::to_string(id) + " is outside [0, " + std::to_string(vocab) + ")";
        return false;
      }
    }
    if (std::find(choices->begin(), choices->end(), ids) != choices->end()) {
      *error = "--choice-ids: the choice '" + item + "' is given twice";
      return false;
    }
    choices->push_back(std::move(ids));
  }
  if (choices->empty()) {
    *error = "--choice-ids needs at least one choice (ids separated by ',', choices by ';')";
    return false;
  }
  return true;
}

ChoiceMask::ChoiceMask(std::vector<std::vector<int64_t>> choices, std::vector<int64_t> eos, int64_t vocab)
    : choices_(std::move(choices)), eos_(std::move(eos)), vocab_(vocab) {}

bool ChoiceMask::is_prefix(const std::vector<int64_t>& choice, const std::vector<int64_t>& generated) const {
  return generated.size() <= choice.size() && std::equal(generated.begin(), generated.end(), choice.begin());
}

std::vector<int32_t> ChoiceMask::row(const std::vector<int64_t>& generated) const {
  std::vector<uint32_t> words(static_cast<size_t>((vocab_ + 31) / 32), 0u);
  const auto allow = [&](int64_t id) {
    if (id >= 0 && id < vocab_) words[static_cast<size_t>(id / 32)] |= 1u << (id % 32);
  };
  for (const auto& choice : choices_) {
    if (!is_prefix(choice, generated)) continue;
    if (choice.size() > generated.size()) {
      allow(choice[generated.size()]);
    } else {
      for (int64_t id : eos_) allow(id);
    }
  }
  return std::vector<int32_t>(words.begin(), words.end());
}

bool ChoiceMask::finished(const std::vector<int64_t>& generated) const {
  bool whole = false;
  for (const auto& choice : choices_) {
    if (!is_prefix(choice, generated)) continue;
    if (choice.size() > generated.size()) return false;  // a longer choice may still follow
    whole = true;
  }
  return whole;
}

}  // namespace etmlx
