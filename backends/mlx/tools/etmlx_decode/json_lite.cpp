#include "json_lite.h"

#include <cerrno>
#include <cstdlib>

namespace etmlx::json {

const Value* Value::find(const std::string& key) const {
  if (kind != Kind::Object) return nullptr;
  for (const auto& [name, value] : members)
    if (name == key) return &value;
  return nullptr;
}

std::optional<int64_t> Value::as_int() const {
  if (kind != Kind::Number) return std::nullopt;
  // An integer literal only: "2.0" or "1e3" are not token ids.
  if (text.find_first_of(".eE") != std::string::npos) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || *end != '\0') return std::nullopt;
  return static_cast<int64_t>(v);
}

std::optional<double> Value::as_double() const {
  if (kind != Kind::Number) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0') return std::nullopt;
  return v;
}

namespace {

// Deep enough for any sidecar; bounds the recursion on hostile input.
constexpr int kMaxDepth = 64;

class Parser {
 public:
  explicit Parser(const std::string& s) : s_(s) {}

  std::optional<Value> document(std::string* error) {
    Value v;
    skip_space();
    if (value(&v, 0)) {
      skip_space();
      if (pos_ == s_.size()) return v;
      fail("unexpected text after the value");
    }
    *error = error_ + " at byte " + std::to_string(pos_);
    return std::nullopt;
  }

 private:
  const std::string& s_;
  size_t pos_ = 0;
  std::string error_;

  bool fail(const char* what) {
    if (error_.empty()) error_ = what;
    return false;
  }
  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[pos_]; }
  void skip_space() {
    while (!at_end() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  bool literal(const char* word) {
    size_t n = 0;
    while (word[n]) ++n;
    if (s_.compare(pos_, n, word) != 0) return fail("invalid literal");
    pos_ += n;
    return true;
  }

  bool value(Value* out, int depth) {
    if (depth > kMaxDepth) return fail("nesting too deep");
    switch (peek()) {
      case '{': return object(out, depth);
      case '[': return array(out, depth);
      case '"': out->kind = Value::Kind::String; return string(&out->text);
      case 't': out->kind = Value::Kind::Bool; out->boolean = true; return literal("true");
      case 'f': out->kind = Value::Kind::Bool; out->boolean = false; return literal("false");
      case 'n': out->kind = Value::Kind::Null; return literal("null");
      default: return number(out);
    }
  }

  bool object(Value* out, int depth) {
    out->kind = Value::Kind::Object;
    ++pos_;
    skip_space();
    if (peek() == '}') { ++pos_; return true; }
    for (;;) {
      skip_space();
      if (peek() != '"') return fail("expected a member name");
      std::string key;
      if (!string(&key)) return false;
      skip_space();
      if (peek() != ':') return fail("expected ':'");
      ++pos_;
      skip_space();
      Value v;
      if (!value(&v, depth + 1)) return false;
      out->members.emplace_back(std::move(key), std::move(v));
      skip_space();
      if (peek() == ',') { ++pos_; continue; }
      if (peek() == '}') { ++pos_; return true; }
      return fail("expected ',' or '}'");
    }
  }

  bool array(Value* out, int depth) {
    out->kind = Value::Kind::Array;
    ++pos_;
    skip_space();
    if (peek() == ']') { ++pos_; return true; }
    for (;;) {
      skip_space();
      Value v;
      if (!value(&v, depth + 1)) return false;
      out->items.push_back(std::move(v));
      skip_space();
      if (peek() == ',') { ++pos_; continue; }
      if (peek() == ']') { ++pos_; return true; }
      return fail("expected ',' or ']'");
    }
  }

  bool digits() {
    const size_t start = pos_;
    while (!at_end() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    return pos_ > start || fail("expected a digit");
  }

  bool number(Value* out) {
    if (at_end()) return fail("unexpected end of input");
    const size_t start = pos_;
    if (peek() == '-') ++pos_;
    if (peek() == '0') {
      ++pos_;
    } else if (peek() < '1' || peek() > '9') {
      return fail("unexpected character");
    } else if (!digits()) {
      return false;
    }
    if (peek() == '.') {
      ++pos_;
      if (!digits()) return false;
    }
    if (peek() == 'e' || peek() == 'E') {
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (!digits()) return false;
    }
    out->kind = Value::Kind::Number;
    out->text = s_.substr(start, pos_ - start);
    return true;
  }

  bool hex4(uint32_t* out) {
    if (pos_ + 4 > s_.size()) return fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<uint32_t>(c - 'A' + 10);
      else return fail("bad \\u escape");
    }
    *out = v;
    return true;
  }

  static void append_utf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  bool escape(std::string* out) {
    if (at_end()) return fail("unterminated string");
    const char c = s_[pos_++];
    switch (c) {
      case '"': case '\\': case '/': out->push_back(c); return true;
      case 'b': out->push_back('\b'); return true;
      case 'f': out->push_back('\f'); return true;
      case 'n': out->push_back('\n'); return true;
      case 'r': out->push_back('\r'); return true;
      case 't': out->push_back('\t'); return true;
      case 'u': break;
      default: return fail("bad escape");
    }
    uint32_t cp = 0;
    if (!hex4(&cp)) return false;
    if (cp >= 0xD800 && cp < 0xDC00) {
      // A high surrogate must be followed by its low half.
      uint32_t low = 0;
      if (s_.compare(pos_, 2, "\\u") != 0) return fail("lone surrogate");
      pos_ += 2;
      if (!hex4(&low)) return false;
      if (low < 0xDC00 || low >= 0xE000) return fail("lone surrogate");
      cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
    } else if (cp >= 0xDC00 && cp < 0xE000) {
      return fail("lone surrogate");
    }
    append_utf8(cp, out);
    return true;
  }

  bool string(std::string* out) {
    ++pos_;  // opening quote
    for (;;) {
      if (at_end()) return fail("unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return true;
      if (c == '\\') {
        if (!escape(out)) return false;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        return fail("control character in a string");
      } else {
        out->push_back(c);
      }
    }
  }
};

}  // namespace

std::optional<Value> parse(const std::string& source, std::string* error) {
  return Parser(source).document(error);
}

}  // namespace etmlx::json
