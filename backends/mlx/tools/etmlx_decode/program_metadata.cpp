#include "program_metadata.h"

#include <cstring>

namespace etmlx {

namespace {

constexpr char kMetaKey[] = "etmlx/decoder_meta.json";
constexpr char kTokenizerPrefix[] = "etmlx/tokenizer/";

using executorch::runtime::Error;
using executorch::runtime::NamedDataMap;

bool read_blob(const NamedDataMap& map, const char* key, std::string* out) {
  auto data = map.get_data(key);
  if (!data.ok()) return false;
  out->assign(static_cast<const char*>(data->data()), data->size());
  data->Free();
  return true;
}

}  // namespace

std::optional<ProgramMetadata> read_program_metadata(executorch::extension::module::Module& module,
                                                     const std::string& pte, std::string* error) {
  ProgramMetadata out;
  const NamedDataMap* map = nullptr;
  if (const auto program = module.program()) {
    const auto named = program->get_named_data_map();
    if (named.ok()) map = named.get();  // NotFound: a program without named data
  }
  std::string blob;
  if (map && read_blob(*map, kMetaKey, &blob)) {
    out.origin = pte + " (named data " + kMetaKey + ")";
    auto meta = parse_sidecar(blob, out.origin, error);
    if (!meta) return std::nullopt;
    out.meta = std::move(*meta);
    out.found = true;
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
  out.origin = pte + ".json";
  auto meta = read_sidecar(out.origin, &out.found, error);
  if (!meta) return std::nullopt;
  out.meta = std::move(*meta);
  return out;
}

}  // namespace etmlx
