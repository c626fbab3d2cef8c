// What `etmlx export` stores inside a decoder .pte besides the program: the
// decoder metadata and the tokenizer's files, as ExecuTorch named data
// (backends/mlx/llm/decoder/meta.py writes the same keys). Programs exported
// before that carry none; their metadata is FILE.pte.json beside the file.
#pragma once

#include <map>
#include <optional>
#include <string>

#include <executorch/extension/module/module.h>

#include "sidecar.h"

namespace etmlx {

struct ProgramMetadata {
  Sidecar meta;
  bool found = false;  // embedded or from a sidecar; else `meta` is empty
  std::string origin;  // where `meta` came from, for messages
  // Tokenizer file name (tokenizer.json, tokenizer_config.json, ...) -> bytes.
  std::map<std::string, std::string> tokenizer_files;
};

// Reads the named data of the loaded `module` (a program at `pte`), falling
// back to `pte`.json. Returns nullopt with `error` set on malformed metadata.
std::optional<ProgramMetadata> read_program_metadata(executorch::extension::module::Module& module,
                                                     const std::string& pte, std::string* error);

}  // namespace etmlx
