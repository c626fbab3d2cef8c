// FILE.pte.json, written beside the .pte by `etmlx export`: what the decode
// loop needs to know that the program itself does not say (vocabulary size,
// end-of-sequence ids, input names, the sampler knobs).
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
};

// Reads `path`. Returns nullopt with `error` set when the file exists but
// cannot be read, declares another format, or a known field has the wrong
// type; a missing file gives an empty Sidecar (`*found` = false).
std::optional<Sidecar> read_sidecar(const std::string& path, bool* found, std::string* error);

}  // namespace etmlx
