#include "text_tokenizer.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <system_error>

#ifdef ETMLX_HAVE_PYTORCH_TOKENIZERS
#include <stdlib.h>  // mkdtemp

// hf_tokenizer.h names std::function and hash maps through headers the wheel
// does not ship (see tokenizer_shim/); include them first.
#include <functional>
#include <unordered_map>

#include <pytorch/tokenizers/hf_tokenizer.h>
#endif

namespace etmlx {

namespace {

// Length of the UTF-8 sequence a lead byte starts (1 for a stray continuation
// byte, so it is passed on rather than held forever).
size_t sequence_length(unsigned char lead) {
  if (lead >= 0xF0 && lead < 0xF8) return 4;
  if (lead >= 0xE0) return 3;
  if (lead >= 0xC0) return 2;
  return 1;
}

#ifdef ETMLX_HAVE_PYTORCH_TOKENIZERS

class HfTextTokenizer final : public TextTokenizer {
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
    return true;
  }

  bool encode(const std::string& text, std::vector<int64_t>* ids, std::string* error) const override {
    const auto out = tok_.encode(text, /*bos=*/0, /*eos=*/0);
    if (!out.ok()) {
      *error = "the tokenizer cannot encode the prompt (pytorch_tokenizers error " +
               std::to_string(static_cast<int>(out.error())) + ")";
      return false;
    }
    ids->assign(out->begin(), out->end());
    return true;
  }

  std::string piece(int64_t id) const override {
    const auto text = tok_.decode(std::vector<uint64_t>{static_cast<uint64_t>(id)}, /*skip_special_tokens=*/true);
    return text.ok() ? *text : std::string();
  }

 private:
  tokenizers::HFTokenizer tok_;
};

#endif  // ETMLX_HAVE_PYTORCH_TOKENIZERS

}  // namespace

bool TextTokenizer::available() {
#ifdef ETMLX_HAVE_PYTORCH_TOKENIZERS
  return true;
#else
  return false;
#endif
}

std::unique_ptr<TextTokenizer> TextTokenizer::load(const std::map<std::string, std::string>& files,
                                                   std::string* error) {
#ifdef ETMLX_HAVE_PYTORCH_TOKENIZERS
  auto tok = std::make_unique<HfTextTokenizer>();
  if (!tok->load(files, error)) return nullptr;
  return tok;
#else
  (void)files;
  *error = "this etmlx_decode was built without a tokenizer library (pytorch_tokenizers was not found by CMake)";
  return nullptr;
#endif
}

std::string lossy_utf8(const std::string& bytes) {
  static const char kReplacement[] = "\xEF\xBF\xBD";
  std::string out;
  const size_t n = bytes.size();
  for (size_t i = 0; i < n;) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    // Well-formed sequences (Unicode Table 3-7): the length, and the range of
    // the second byte (later ones are 80..BF).
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c == 0xE0) {
      len = 3, lo = 0xA0;
    } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
      len = 3;
    } else if (c == 0xED) {
      len = 3, hi = 0x9F;
    } else if (c == 0xF0) {
      len = 4, lo = 0x90;
    } else if (c >= 0xF1 && c <= 0xF3) {
      len = 4;
    } else if (c == 0xF4) {
      len = 4, hi = 0x8F;
    }
    size_t j = 1;
    while (len && j < len && i + j < n) {
      const auto b = static_cast<unsigned char>(bytes[i + j]);
      if (j == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) break;
      ++j;
    }
    if (len && j == len) {
      out.append(bytes, i, len);
    } else {
      out += kReplacement;
    }
    i += j;
  }
  return out;
}

std::string Utf8Stream::feed(const std::string& bytes) {
  pending_ += bytes;
  // Find the start of the last sequence and check that it is complete.
  size_t cut = pending_.size();
  for (size_t back = 1; back <= 4 && back <= pending_.size(); ++back) {
    const auto c = static_cast<unsigned char>(pending_[pending_.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    if (sequence_length(c) > back) cut = pending_.size() - back;
    break;
  }
  std::string out = lossy_utf8(pending_.substr(0, cut));
  pending_.erase(0, cut);
  return out;
}

std::string Utf8Stream::flush() {
  std::string out = lossy_utf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace etmlx
