// The decoder metadata `etmlx export` stores in the .pte's named data
// (program_metadata.h finds it; older exports wrote it to FILE.pte.json
// beside the .pte): what the decode loop needs to know that the program's
// tensors do not say (vocabulary size, end-of-sequence ids, input names, the
// sampler knobs).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "knobs.h"

namespace etmlx {

// The "format" a decoder sidecar declares (backends/mlx/llm/decoder/meta.py).
extern const char kSidecarFormat[];

struct Sidecar {
  std::optional<int64_t> max_seq_len;
  std::optional<int64_t> vocab_size;
  std::optional<int64_t> batch;
  std::vector<int64_t> eos_token_ids;
  std::optional<std::vector<std::string>> inputs;  // input names in call order
  std::optional<std::vector<KnobSpec>> knobs;       // the knob table (knobs.h)
  // Ids the tokenizer adds around a text prompt (BOS, ...).
  std::vector<int64_t> prompt_prefix_ids, prompt_suffix_ids;
  // Each call returns the previous call's outputs; a token input < 0 is the row's last sampled token
  // (decode_loop.h). Absent in programs exported before pipelining: false.
  bool pipelined = false;
  // A draft-verifying program (`etmlx export --draft-tokens K`): K, and the fewest verify columns a call
  // carries (absent in programs exported before one-column calls: 2). 0 for a plain program.
  int64_t draft_tokens = 0;
  int64_t verify_min_width = 2;
  // A draft model's program that returns K tokens per row per call (`--propose-tokens K`; output 0 is
  // [batch, K], column 0 the plain token): K, or 0 for a plain [batch] output.
  int64_t propose_tokens = 0;
  // Whether some layer keeps a sliding-window ring cache (a row is then reused only where positions continue,
  // decode_rows.h); absent in programs exported before the field: nullopt, treated as a ring.
  std::optional<bool> ring_cache;
};

// Parses the metadata JSON `text`; `where` names its origin in errors.
// Returns nullopt with `error` set when it is not JSON, declares another
// format, or a known field has the wrong type.
std::optional<Sidecar> parse_sidecar(const std::string& text, const std::string& where, std::string* error);

// Reads the file `path` with parse_sidecar; a missing file gives an empty
// Sidecar (`*found` = false).
std::optional<Sidecar> read_sidecar(const std::string& path, bool* found, std::string* error);

}  // namespace etmlx
