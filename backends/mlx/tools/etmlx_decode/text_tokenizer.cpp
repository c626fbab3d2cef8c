#include "text_tokenizer.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <system_error>

#ifdef __APPLE__
#include <mach-o/dyld.h>  // _NSGetExecutablePath
#endif

#include "options.h"
#include "tokenizer_plugin.h"

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

#ifdef ETMLX_TEXT_TOKENIZER_PLUGIN
// Points fd 2 at /dev/null while alive: the tokenizer library logs from its
// static initializers and its loader, and etmlx_decode's stderr carries only
// its own one-line errors.
class MutedStderr {
 public:
  MutedStderr() {
    std::fflush(stderr);
    saved_ = dup(2);
    const int null = open("/dev/null", O_WRONLY);
    if (saved_ >= 0 && null >= 0) dup2(null, 2);
    if (null >= 0) close(null);
  }
  ~MutedStderr() {
    std::fflush(stderr);
    if (saved_ >= 0) {
      dup2(saved_, 2);
      close(saved_);
    }
  }
  MutedStderr(const MutedStderr&) = delete;
  MutedStderr& operator=(const MutedStderr&) = delete;

 private:
  int saved_ = -1;
};

// The plugin: $ETMLX_TEXT_TOKENIZER_PLUGIN if set, else the file CMake builds
// next to this program.
std::filesystem::path plugin_path() {
  if (const std::string& path = options::process().text_tokenizer_plugin; !path.empty()) return path;
  std::string exe;
#ifdef __APPLE__
  char buf[PATH_MAX];
  uint32_t size = sizeof(buf);
  if (_NSGetExecutablePath(buf, &size) == 0) exe = buf;
#else
  std::error_code ec;
  exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
#endif
  return std::filesystem::path(exe).parent_path() / ETMLX_TEXT_TOKENIZER_PLUGIN;
}
#endif  // ETMLX_TEXT_TOKENIZER_PLUGIN

}  // namespace

bool TextTokenizer::available() {
#ifdef ETMLX_TEXT_TOKENIZER_PLUGIN
  std::error_code ec;
  return std::filesystem::exists(plugin_path(), ec);
#else
  return false;
#endif
}

std::unique_ptr<TextTokenizer> TextTokenizer::load(const std::map<std::string, std::string>& files,
                                                   std::string* error) {
#ifdef ETMLX_TEXT_TOKENIZER_PLUGIN
  const std::string path = plugin_path().string();
  std::string dl_error;
  TextTokenizer* tok = nullptr;
  {
    MutedStderr muted;
    // Never closed: the tokenizer's code must outlive every TextTokenizer.
    void* plugin = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    auto entry = plugin ? reinterpret_cast<EtmlxTextTokenizerLoad>(dlsym(plugin, ETMLX_TEXT_TOKENIZER_LOAD_SYMBOL))
                        : nullptr;
    if (!entry) {
      const char* why = dlerror();
      dl_error = why ? why : "unknown dlopen error";
    } else {
      tok = entry(files, error);
    }
  }
  if (!dl_error.empty()) {
    *error = "cannot load the tokenizer plugin " + path + " (" + dl_error + ")";
    return nullptr;
  }
  return std::unique_ptr<TextTokenizer>(tok);
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
