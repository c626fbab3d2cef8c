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

bool read_ids(const Value& root, const char* key, std::vector<int64_t>* out, std::string* error) {
  const Value* list = root.find(key);
  if (!list || list->kind == Value::Kind::Null) return true;
  bool ok = list->kind == Value::Kind::Array;
  for (const Value& item : list->items) {
    const auto id = item.as_int();
    ok = ok && id.has_value();
    if (ok) out->push_back(*id);
  }
  if (!ok) *error = std::string("\"") + key + "\" must be a list of integers";
  return ok;
}

}  // namespace

std::optional<Sidecar> read_sidecar(const std::string& path, bool* found, std::string* error) {
  std::ifstream in(path, std::ios::binary);
  *found = static_cast<bool>(in);
  if (!in) return Sidecar{};
  std::stringstream buf;
  buf << in.rdbuf();
  if (in.bad()) {
    *error = "could not read " + path;
    return std::nullopt;
  }
  return parse_sidecar(buf.str(), path, error);
}

std::optional<Sidecar> parse_sidecar(const std::string& text, const std::string& path, std::string* error) {
  Sidecar meta;
  std::string why;
  const auto root = json::parse(text, &why);
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
  std::optional<int64_t> draft_tokens, min_width, propose_tokens;
  if (!read_int(*root, "draft_tokens", 0, &draft_tokens, &why) ||
      !read_int(*root, "verify_min_width", 1, &min_width, &why) ||
      !read_int(*root, "propose_tokens", 0, &propose_tokens, &why)) {
    *error = path + ": " + why;
    return std::nullopt;
  }
  meta.draft_tokens = draft_tokens.value_or(0);
  meta.verify_min_width = min_width.value_or(2);
  meta.propose_tokens = propose_tokens.value_or(0);
  if (!read_ids(*root, "eos_token_ids", &meta.eos_token_ids, &why) ||
      !read_ids(*root, "prompt_prefix_ids", &meta.prompt_prefix_ids, &why) ||
      !read_ids(*root, "prompt_suffix_ids", &meta.prompt_suffix_ids, &why)) {
    *error = path + ": " + why;
    return std::nullopt;
  }
  for (const char* name : {"pipelined", "ring_cache"}) {
    const Value* flag = root->find(name);
    if (!flag || flag->kind == Value::Kind::Null) continue;
    if (flag->kind != Value::Kind::Bool) {
      *error = path + ": \"" + name + "\" must be true or false";
      return std::nullopt;
    }
    if (std::string(name) == "pipelined") meta.pipelined = flag->boolean;
    else meta.ring_cache = flag->boolean;
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
