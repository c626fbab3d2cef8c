#include "sidecar.h"

#include <fstream>
#include <sstream>

#include "json_lite.h"

namespace etmlx {

const char kSidecarFormat[] = "etmlx-decoder/1";

namespace {

using json::Value;

bool read_int(const Value& root, const char* key, int64_t min, std::optional<int64_t>* out,
              std::string* error) {
  const Value* v = root.find(key);
  if (!v || v->kind == Value::Kind::Null) return true;
  const auto n = v->as_int();
  if (!n || *n < min) {
    *error = std::string("\"") + key + "\" must be an integer >= " + std::to_string(min);
    return false;
  }
  *out = *n;
  return true;
}

}  // namespace

std::optional<Sidecar> read_sidecar(const std::string& path, bool* found, std::string* error) {
  Sidecar meta;
  std::ifstream in(path, std::ios::binary);
  *found = static_cast<bool>(in);
  if (!in) return meta;
  std::stringstream buf;
  buf << in.rdbuf();
  if (in.bad()) {
    *error = "could not read " + path;
    return std::nullopt;
  }
  std::string why;
  const auto root = json::parse(buf.str(), &why);
  if (!root) {
    *error = path + " is not valid JSON: " + why;
    return std::nullopt;
  }
  if (root->kind != Value::Kind::Object) {
    *error = path + " must hold a JSON object";
    return std::nullopt;
  }
  const Value* format = root->find("format");
  if (!format || format->kind != Value::Kind::String || format->text != kSidecarFormat) {
    *error = path + " is not etmlx decoder metadata (\"format\": \"" + kSidecarFormat + "\" expected)";
    return std::nullopt;
  }
  if (!read_int(*root, "max_seq_len", 1, &meta.max_seq_len, &why) ||
      !read_int(*root, "vocab_size", 1, &meta.vocab_size, &why) ||
      !read_int(*root, "batch", 1, &meta.batch, &why)) {
    *error = path + ": " + why;
    return std::nullopt;
  }
  if (const Value* eos = root->find("eos_token_ids"); eos && eos->kind != Value::Kind::Null) {
    if (eos->kind != Value::Kind::Array) {
      *error = path + ": \"eos_token_ids\" must be a list of integers";
      return std::nullopt;
    }
    for (const Value& item : eos->items) {
      const auto id = item.as_int();
      if (!id) {
        *error = path + ": \"eos_token_ids\" must be a list of integers";
        return std::nullopt;
      }
      meta.eos_token_ids.push_back(*id);
    }
  }
  if (const Value* inputs = root->find("inputs"); inputs && inputs->kind != Value::Kind::Null) {
    std::vector<std::string> names;
    bool ok = inputs->kind == Value::Kind::Array;
    for (const Value& item : inputs->items) {
      ok = ok && item.kind == Value::Kind::String;
      names.push_back(item.text);
    }
    if (!ok) {
      *error = path + ": \"inputs\" must be a list of strings";
      return std::nullopt;
    }
    meta.inputs = std::move(names);
  }
  if (const Value* knobs = root->find("knobs"); knobs && knobs->kind != Value::Kind::Null) {
    meta.knobs.emplace();
    if (!read_knobs(*knobs, &*meta.knobs, &why)) {
      *error = path + ": " + why;
      return std::nullopt;
    }
  }
  return meta;
}

}  // namespace etmlx
