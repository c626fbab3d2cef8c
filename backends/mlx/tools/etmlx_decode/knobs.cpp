#include "knobs.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace etmlx {

namespace {

namespace fb = backends::mlx::serialization::generated::fb;

std::string trim(const std::string& s) {
  const char* space = " \t\r\n";
  const size_t a = s.find_first_not_of(space);
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(space) - a + 1);
}

std::optional<KnobValue> number(const fb::KnobNumber* v) {
  if (!v) return std::nullopt;
  return KnobValue{v->i(), v->f()};
}

std::string text(const flatbuffers::String* s) { return s ? s->str() : std::string(); }

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

bool read_knobs(const flatbuffers::Vector<flatbuffers::Offset<fb::DecoderKnob>>* knobs, std::vector<KnobSpec>* out,
                std::string* error) {
  if (!knobs || knobs->size() == 0) {
    *error = "the metadata lists no \"knobs\"";
    return false;
  }
  for (flatbuffers::uoffset_t n = 0; n < knobs->size(); ++n) {
    const fb::DecoderKnob& entry = *knobs->Get(n);
    const std::string where = "\"knobs\"[" + std::to_string(n) + "]";
    const std::string dtype = entry.dtype()->str();  // name, dtype and off are required (the verifier checked)
    if (dtype != "int64" && dtype != "int32" && dtype != "float32") {
      *error = where + ": dtype must be int64, int32 or float32, got " + dtype;
      return false;
    }
    KnobSpec spec;
    spec.name = entry.name()->str();
    spec.integer = dtype != "float32";  // int32: the allowed-token bitmask words
    spec.off = *number(entry.off());
    spec.low = number(entry.low());
    spec.high = number(entry.high());
    spec.first = number(entry.first());
    spec.low_open = entry.low_open();
    spec.high_open = entry.high_open();
    spec.flag = text(entry.flag());
    spec.range = text(entry.range());
    spec.export_hint = text(entry.export_());
    if (!spec.flag.empty() && spec.flag.rfind("--", 0) != 0) {
      *error = where + ": \"flag\" must start with --";
      return false;
    }
    out->push_back(std::move(spec));
  }
  return true;
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
