// libetmlx_text_tokenizer: TextTokenizer through pytorch_tokenizers'
// HFTokenizer, the C++ tokenizer library ExecuTorch's own LLM runners use.
// Loaded by text_tokenizer.cpp; see tokenizer_plugin.h for why it is a plugin.
#include <stdlib.h>  // mkdtemp (glibc)
#include <unistd.h>  // mkdtemp (macOS)

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <vector>

// hf_tokenizer.h names std::function and hash maps through headers the wheel
// does not ship (see tokenizer_shim/); include them first.
#include <functional>
#include <unordered_map>

#include <pytorch/tokenizers/hf_tokenizer.h>

#include "long_runs.h"
#include "tokenizer_plugin.h"

namespace {

// The longest run of one kind (long_runs.h) handed to the tokenizer at once:
// pytorch_tokenizers' std::regex matcher recurses per character of a match and
// overflowed the stack at ~40,000; 4,096 leaves it ten times the room.
constexpr size_t kMaxRun = 4096;

// HFTokenizer with the added tokens it matches in raw text readable (its base
// keeps them in a protected member): a cut must not split one.
class AddedTokensTokenizer final : public tokenizers::HFTokenizer {
 public:
  std::vector<std::string> added_tokens() const {
    std::vector<std::string> out;
    if (!special_token_map_) return out;
    for (size_t i = 0; i < special_token_map_->size(); ++i) {
      const auto [text, id] = special_token_map_->getElement(i);
      if (text.size() > 1) out.emplace_back(text);
    }
    return out;
  }
};

class HfTextTokenizer final : public etmlx::TextTokenizer {
 public:
  bool load(const std::map<std::string, std::string>& files, std::string* error) {
    if (!files.count("tokenizer.json")) {
      *error = "the program's tokenizer has no tokenizer.json (etmlx_decode reads Hugging Face fast tokenizers)";
      return false;
    }
    // HFTokenizer::load reads a directory (tokenizer.json, and the special
    // tokens from tokenizer_config.json): lay the embedded files out in one.
    namespace fs = std::filesystem;
    std::error_code ec;
    std::string pattern = (fs::temp_directory_path(ec) / "etmlx_tokenizer.XXXXXX").string();
    if (ec || !mkdtemp(pattern.data())) {
      *error = "cannot create a temporary directory for the tokenizer";
      return false;
    }
    const fs::path dir = pattern;
    bool written = true;
    for (const auto& [name, bytes] : files) {
      if (name.empty() || name.find('/') != std::string::npos || name[0] == '.') continue;
      std::ofstream out(dir / name, std::ios::binary);
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      written = written && static_cast<bool>(out);
    }
    const auto status = written ? tok_.load(dir.string()) : tokenizers::Error::LoadFailure;
    fs::remove_all(dir, ec);
    if (status != tokenizers::Error::Ok) {
      *error = "cannot load the program's tokenizer (pytorch_tokenizers error " +
               std::to_string(static_cast<int>(status)) + ")";
      return false;
    }
    added_ = tok_.added_tokens();
    return true;
  }

  bool encode(const std::string& text, std::vector<int64_t>* ids, std::string* error) const override {
    ids->clear();
    for (const std::string_view piece : etmlx::split_long_runs(text, kMaxRun, added_)) {
      const auto out = tok_.encode(std::string(piece), /*bos=*/0, /*eos=*/0);
      if (!out.ok()) {
        *error = "the tokenizer cannot encode the prompt (pytorch_tokenizers error " +
                 std::to_string(static_cast<int>(out.error())) + ")";
        return false;
      }
      ids->insert(ids->end(), out->begin(), out->end());
    }
    return true;
  }

  std::string piece(int64_t id) const override {
    const auto text = tok_.decode(std::vector<uint64_t>{static_cast<uint64_t>(id)}, /*skip_special_tokens=*/true);
    return text.ok() ? *text : std::string();
  }

 private:
  AddedTokensTokenizer tok_;
  std::vector<std::string> added_;
};

}  // namespace

extern "C" __attribute__((visibility("default"))) etmlx::TextTokenizer* etmlx_text_tokenizer_load(
    const std::map<std::string, std::string>& files, std::string* error) {
  auto tok = std::make_unique<HfTextTokenizer>();
  if (!tok->load(files, error)) return nullptr;
  return tok.release();
}

// The declaration the loader uses must match this definition.
[[maybe_unused]] static const EtmlxTextTokenizerLoad kEntryPointMatches = &etmlx_text_tokenizer_load;
