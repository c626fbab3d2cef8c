// Cuts text with very long unbroken runs into pieces a tokenizer can take.
//
// pytorch_tokenizers' byte-level pre-tokenizer matches each pre-token with
// std::regex, whose matcher recurses once per character of the match: one
// word (or run of emoji, or of spaces) of ~40,000 characters overflows the
// stack. A run longer than `max_run` bytes is therefore cut into pieces of at
// most `max_run` bytes, each tokenized on its own. Text without such a run is
// one piece, so its tokens are exactly the tokenizer's; a cut run's tokens
// may differ from the whole run's near each cut.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace etmlx {

// A run: consecutive bytes that are all ASCII whitespace or all not. Cuts fall
// on UTF-8 character boundaries, preferably where the kind of character
// changes (letter, digit, other ASCII, non-ASCII: a pre-token boundary
// anyway), and never inside an occurrence of one of `keep_whole` (the
// tokenizer's added tokens, which it matches in the raw text).
std::vector<std::string_view> split_long_runs(std::string_view text, size_t max_run,
                                              const std::vector<std::string>& keep_whole);

}  // namespace etmlx
