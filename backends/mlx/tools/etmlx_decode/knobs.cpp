#include "knobs.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace etmlx {

namespace {

using json::Value;

std::string trim(const std::string& s) {
  const char* space = " \t\r\n";
  const size_t a = s.find_first_not_of(space);
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(space) - a + 1);
}

std::optional<KnobValue> number(const Value* v) {
  if (!v || v->kind != Value::Kind::Number) return std::nullopt;
  KnobValue out;
  out.f = *v->as_double();
  const auto i = v->as_int();
  out.i = i ? *i : static_cast<int64_t>(out.f);
  return out;
}

bool text_field(const Value& entry, const char* key, std::string* out) {
  const Value* v = entry.find(key);
  if (!v || v->kind == Value::Kind::Null) return true;
  if (v->kind != Value::Kind::String) return false;
  *out = v->text;
  return true;
}

bool bool_field(const Value& entry, const char* key, bool* out) {
  const Value* v = entry.find(key);
  if (!v || v->kind == Value::Kind::Null) return true;
  if (v->kind != Value::Kind::Bool) return false;
  *out = v->boolean;
  return true;
}

bool bound(const Value& entry, const char* key, std::optional<KnobValue>* out) {
  const Value* v = entry.find(key);
  if (!v || v->kind == Value::Kind::Null) return true;
  *out = number(v);
  return out->has_value();
}

// The command line's text as this knob's number; false if it is not one.
bool parse_value(const KnobSpec& spec, const std::string& text, KnobValue* out) {
  const std::string t = trim(text);
  if (t.empty()) return false;
  errno = 0;
  char* end = nullptr;
  if (spec.integer) {
    const long long v = std::strtoll(t.c_str(), &end, 10);
    if (errno != 0 || *end != '\0') return false;  // ERANGE: does not fit int64
    out->i = v;
    out->f = static_cast<double>(v);
    return true;
  }
  const float v = std::strtof(t.c_str(), &end);
  // ERANGE on underflow still gives a usable (tiny or zero) value.
  if (*end != '\0' || (errno == ERANGE && std::isinf(v)) || std::isnan(v)) return false;
  out->f = v;
  out->i = static_cast<int64_t>(v);
  return true;
}

bool in_range(const KnobSpec& spec, const KnobValue& v) {
  if (spec.integer) {
    if (spec.low && (spec.low_open ? v.i <= spec.low->i : v.i < spec.low->i)) return false;
    return !spec.high || (spec.high_open ? v.i < spec.high->i : v.i <= spec.high->i);
  }
  if (spec.low && (spec.low_open ? v.f <= spec.low->f : v.f < spec.low->f)) return false;
  return !spec.high || (spec.high_open ? v.f < spec.high->f : v.f <= spec.high->f);
}

}  // namespace

bool read_knobs(const Value& knobs, std::vector<KnobSpec>* out, std::string* error) {
  if (knobs.kind != Value::Kind::Array) {
    *error = "\"knobs\" must be a list";
    return false;
  }
  for (size_t n = 0; n < knobs.items.size(); ++n) {
    const Value& entry = knobs.items[n];
    const std::string where = "\"knobs\"[" + std::to_string(n) + "]";
    KnobSpec spec;
    const Value* name = entry.find("name");
    const Value* dtype = entry.find("dtype");
    const auto off = number(entry.find("off"));
    if (!name || name->kind != Value::Kind::String || !dtype || dtype->kind != Value::Kind::String ||
        (dtype->text != "int64" && dtype->text != "int32" && dtype->text != "float32") || !off) {
      *error = where + " needs \"name\", \"dtype\" (int64, int32 or float32) and a numeric \"off\"";
      return false;
    }
    spec.name = name->text;
    spec.integer = dtype->text != "float32";  // int32: the allowed-token bitmask words
    spec.off = *off;
    if (!bound(entry, "low", &spec.low) || !bound(entry, "high", &spec.high) ||
        !bound(entry, "first", &spec.first)) {
      *error = where + ": \"low\", \"high\" and \"first\" must be numbers or null";
      return false;
    }
    if (!bool_field(entry, "low_open", &spec.low_open) || !bool_field(entry, "high_open", &spec.high_open) ||
        !text_field(entry, "flag", &spec.flag) || !text_field(entry, "range", &spec.range) ||
        !text_field(entry, "export", &spec.export_hint)) {
      *error = where + ": \"low_open\"/\"high_open\" must be booleans, \"flag\", \"range\", \"export\" strings";
      return false;
    }
    if (!spec.flag.empty() && spec.flag.rfind("--", 0) != 0) {
      *error = where + ": \"flag\" must start with --";
      return false;
    }
    out->push_back(std::move(spec));
  }
  return true;
}

const std::vector<KnobSpec>& builtin_knobs() {
  static const std::vector<KnobSpec> knobs = [] {
    KnobSpec temperature;
    temperature.name = "temperature";
    temperature.low = KnobValue{0, 0};
    temperature.flag = "--temperature";
    temperature.range = "a number >= 0 (0 = greedy)";
    KnobSpec seed;
    seed.name = "seed";
    seed.integer = true;
    // Within +-2**62, so seed + step cannot overflow (SEED_LIMIT in knobs.py).
    seed.low = KnobValue{-(int64_t{1} << 62), -0x1p62};
    seed.high = KnobValue{int64_t{1} << 62, 0x1p62};
    seed.flag = "--seed";
    seed.range = "an integer in [-2**62, 2**62]";
    return std::vector<KnobSpec>{temperature, seed};
  }();
  return knobs;
}

bool is_off(const KnobSpec& spec, const KnobValue& value) {
  return spec.integer ? value.i == spec.off.i : value.f == spec.off.f;
}

bool resolve_knob_flags(const std::vector<KnobSpec>& specs,
                        const std::vector<std::pair<std::string, std::string>>& flags,
                        const std::string& unknown_note, std::map<std::string, KnobValue>* values,
                        std::string* error) {
  for (const KnobSpec& spec : specs) (*values)[spec.name] = spec.off;
  for (const auto& [flag, text] : flags) {
    const KnobSpec* spec = nullptr;
    for (const KnobSpec& s : specs)
      if (!s.flag.empty() && s.flag == flag) spec = &s;
    if (!spec) {
      *error = "unknown option " + flag + unknown_note;
      return false;
    }
    KnobValue v;
    if (!parse_value(*spec, text, &v) || !in_range(*spec, v)) {
      *error = flag + " must be " + (spec->range.empty() ? std::string("in range") : spec->range) + ", got '" +
               text + "'";
      return false;
    }
    (*values)[spec->name] = v;
  }
  return true;
}

}  // namespace etmlx
