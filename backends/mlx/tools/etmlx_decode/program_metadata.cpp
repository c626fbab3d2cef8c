#include "program_metadata.h"

#include <cstring>

namespace etmlx {

namespace {

constexpr char kMetaKey[] = "etmlx/decoder_meta";
// The JSON metadata of older exports: refused with a message saying to re-export.
constexpr char kOldMetaKey[] = "etmlx/decoder_meta.json";
constexpr char kTokenizerPrefix[] = "etmlx/tokenizer/";

using executorch::runtime::NamedDataMap;

const NamedDataMap* named_data(executorch::extension::module::Module& module) {
  if (const auto program = module.program()) {
    const auto named = program->get_named_data_map();
    if (named.ok()) return named.get();  // NotFound: a program without named data
  }
  return nullptr;
}

bool has_key(const NamedDataMap* map, const char* key) {
  return map && map->get_data(key).ok();  // the FreeableBuffer frees itself
}

// The blob under `key`, copied: a std::string's heap buffer is aligned as the flatbuffer verifier wants.
bool read_blob(const NamedDataMap& map, const char* key, std::string* out) {
  auto data = map.get_data(key);
  if (!data.ok()) return false;
  out->assign(static_cast<const char*>(data->data()), data->size());
  data->Free();
  return true;
}

}  // namespace

bool has_decoder_metadata(executorch::extension::module::Module& module) {
  const NamedDataMap* map = named_data(module);
  return has_key(map, kMetaKey) || has_key(map, kOldMetaKey);
}

std::optional<ProgramMetadata> read_program_metadata(executorch::extension::module::Module& module,
                                                     const std::string& pte, std::string* error) {
  ProgramMetadata out;
  const NamedDataMap* map = named_data(module);
  std::string blob;
  if (!map || !read_blob(*map, kMetaKey, &blob)) {
    *error = pte + " carries " +
             (has_key(map, kOldMetaKey) ? "older etmlx metadata (JSON)" : "no etmlx decoder metadata") +
             ": re-export it with `etmlx export`";
    return std::nullopt;
  }
  out.origin = pte + " (named data " + kMetaKey + ")";
  auto meta = parse_decoder_meta(blob.data(), blob.size(), out.origin, error);
  if (!meta) return std::nullopt;
  out.meta = std::move(*meta);
  const auto keys = map->get_num_keys();
  const size_t prefix = std::strlen(kTokenizerPrefix);
  for (uint32_t i = 0; keys.ok() && i < keys.get(); ++i) {
    const auto key = map->get_key(i);
    if (!key.ok() || std::strncmp(key.get(), kTokenizerPrefix, prefix) != 0) continue;
    if (!read_blob(*map, key.get(), &blob)) {
      *error = pte + ": cannot read named data " + key.get();
      return std::nullopt;
    }
    out.tokenizer_files[key.get() + prefix] = blob;
  }
  return out;
}

}  // namespace etmlx
