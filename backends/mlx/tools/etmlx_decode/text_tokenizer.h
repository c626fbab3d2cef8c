// Text <-> token ids for etmlx_decode with the tokenizer a .pte carries
// (tokenizer.json and friends). The implementation lives in a plugin
// (hf_tokenizer_plugin.cpp: pytorch_tokenizers' HFTokenizer, the C++ tokenizer
// library ExecuTorch's own LLM runners use), loaded on first use.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace etmlx {

class TextTokenizer {
 public:
  // Whether this build has the tokenizer plugin (CMake ETMLX_DECODE_TOKENIZER)
  // and its file is in place.
  static bool available();
  // Builds the tokenizer from its files (name -> bytes). nullptr + `error` on failure.
  static std::unique_ptr<TextTokenizer> load(const std::map<std::string, std::string>& files,
                                             std::string* error);
  virtual ~TextTokenizer() = default;

  // The ids of `text` alone (no special tokens).
  virtual bool encode(const std::string& text, std::vector<int64_t>* ids, std::string* error) const = 0;
  // The bytes of one token, special tokens as "" (their text is not output).
  // Bytes of a multi-byte character may be split across tokens: see Utf8Stream.
  virtual std::string piece(int64_t id) const = 0;
};

// `bytes` as valid UTF-8: each ill-formed sequence (its maximal subpart)
// becomes U+FFFD, as Python's errors="replace" and Hugging Face's decoders do.
std::string lossy_utf8(const std::string& bytes);

// Holds back an incomplete UTF-8 sequence at the end of what it is fed, so
// each emitted chunk is whole characters (lossy_utf8 of them).
class Utf8Stream {
 public:
  std::string feed(const std::string& bytes);
  std::string flush();  // whatever is left, complete or not

 private:
  std::string pending_;
};

}  // namespace etmlx
