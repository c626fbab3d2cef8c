// The command line of etmlx_decode, parsed and checked before anything loads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace etmlx {

struct DecodeArgs {
  std::string pte;
  std::vector<int64_t> prompt_ids;
  std::optional<std::string> prompt_text;  // --prompt: tokenized with the program's tokenizer
  int64_t max_tokens = 64;
  // Every other "--flag value": the sampler knobs (--temperature, --seed,
  // --top-k, ...), checked against the knob list of the metadata once it is
  // read (knobs.h), in command-line order.
  std::vector<std::pair<std::string, std::string>> knob_flags;
  std::optional<std::vector<int64_t>> eos_ids;  // replaces the metadata's list
  std::optional<std::string> mask_file;  // per-step allowed-token masks (mask_file.h)
  std::optional<std::string> choice_ids;  // one of these id sequences (choice_mask.h)
  std::optional<std::string> weights;           // --weights FILE.ptd (external weights)
  // Draft-verifying programs (`etmlx export --draft-tokens K`), as `etmlx generate` takes them:
  std::string draft;  // --draft ngram (prompt lookup, the default on such programs) or none
  std::optional<std::string> prediction_text;          // --prediction TEXT|@FILE (Predicted Outputs)
  std::optional<std::vector<int64_t>> prediction_ids;  // --prediction-ids 1,2,3
  std::optional<int64_t> num_draft_tokens;             // --num-draft-tokens: most per call (default K)
  std::optional<int64_t> prefill_chunk;                // --prefill-step-size N: prompt tokens per call (0: all)
  std::optional<std::string> draft_model;              // --draft-model SMALL.pte (model_draft.h)
  std::optional<double> draft_model_cost;              // --draft-model-cost C: fixed, not measured
  std::optional<std::string> adapter_name;  // --adapter-name NAME: one of the program's switchable adapters
  std::vector<std::string> images;          // --image FILE, in prompt order (prompt_images.h)
  std::optional<std::string> dump_pixels;   // --dump-pixels FILE: write the images' pixels and exit
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
