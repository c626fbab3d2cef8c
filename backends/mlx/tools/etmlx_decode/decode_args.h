// The command line of etmlx_decode, parsed and checked before anything loads.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace etmlx {

struct DecodeArgs {
  std::string pte;
  std::vector<int64_t> prompt_ids;
  std::optional<std::string> prompt_text;  // --prompt: tokenized with the program's tokenizer
  int64_t max_tokens = 64;
  float temperature = 0.0f;  // <= 0: greedy
  int64_t seed = 0;          // step k draws with seed + k
  // Sampler knobs given on the command line, by program input name (top_k,
  // top_p, min_p, presence/frequency/repetition_penalty); the rest stay off.
  std::map<std::string, double> knobs;
  std::optional<std::vector<int64_t>> eos_ids;  // replaces the sidecar's list
  std::optional<int64_t> vocab_size;            // for programs without a sidecar
  bool json = false;
  bool help = false;
};

extern const char kDecodeUsage[];

// Fills `out` from argv; on a bad command line returns false with `error`
// naming the argument.
bool parse_decode_args(int argc, char** argv, DecodeArgs* out, std::string* error);

// "1,2,3" -> ids. Empty items and non-integers are errors.
bool parse_id_list(const std::string& text, const char* what, std::vector<int64_t>* out,
                   std::string* error);

}  // namespace etmlx
