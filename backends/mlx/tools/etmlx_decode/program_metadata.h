// What `etmlx export` stores inside a decoder .pte besides the program: the decoder metadata (a DecoderMeta
// flatbuffer, decoder_meta.h) and the tokenizer's files, as ExecuTorch named data
// (backends/mlx/llm/decoder/meta.py writes the same keys).
#pragma once

#include <map>
#include <optional>
#include <string>

#include <executorch/extension/module/module.h>

#include "decoder_meta.h"

namespace etmlx {

struct ProgramMetadata {
  DecoderMeta meta;
  std::string origin;  // where `meta` came from, for messages
  // Tokenizer file name (tokenizer.json, tokenizer_config.json, ...) -> bytes.
  std::map<std::string, std::string> tokenizer_files;
};

// Whether the loaded `module` carries any decoder metadata (this etmlx's or an older one's): a program without
// is not a decoder etmlx exported (etmlx_bench times it as a plain program).
bool has_decoder_metadata(executorch::extension::module::Module& module);

// Reads the named data of the loaded `module` (a program at `pte`). Returns nullopt with `error` set (one line)
// on malformed metadata, or when there is none or only an older etmlx's JSON: such a program must be
// re-exported.
std::optional<ProgramMetadata> read_program_metadata(executorch::extension::module::Module& module,
                                                     const std::string& pte, std::string* error);

}  // namespace etmlx
