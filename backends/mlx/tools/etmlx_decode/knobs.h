// The sampler knobs as the decoder metadata lists them (its "knobs", DecoderKnob tables written from the table
// in backends/mlx/llm/sampler/knobs.py): their flags, ranges and off values, and the command-line values
// checked against them.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "decoder_meta_generated.h"

namespace etmlx {

// A number both ways: int64 exactly (integer knobs) and as a double.
struct KnobValue {
  int64_t i = 0;
  double f = 0;
};

struct KnobSpec {
  std::string name;  // the program input it fills
  bool integer = false;  // int64 values (else float32)
  KnobValue off;         // the value that changes nothing
  std::optional<KnobValue> low, high;  // range; nullopt = unbounded
  bool low_open = false, high_open = false;
  std::string flag;    // "--top-k"; empty: not settable from the command line
  std::string range;   // "an integer >= 0 (0 = off)", for messages
  std::string export_hint;  // "export with --sampler top-k"; empty: always in the program
  std::optional<KnobValue> first;  // the value on a sequence's first call, if not `off`
};

// The knob list of the metadata's `knobs`; false with `error` set on a malformed or missing list.
bool read_knobs(
    const flatbuffers::Vector<flatbuffers::Offset<backends::mlx::serialization::generated::fb::DecoderKnob>>* knobs,
    std::vector<KnobSpec>* out, std::string* error);

bool is_off(const KnobSpec& spec, const KnobValue& value);

// Every spec's value by name: the command line's (flag, text) pairs checked
// against `specs`, the off value for the rest. On an unknown flag (the message
// ends with `unknown_note`) or a value out of range returns false with `error`
// naming the flag.
bool resolve_knob_flags(const std::vector<KnobSpec>& specs,
                        const std::vector<std::pair<std::string, std::string>>& flags,
                        const std::string& unknown_note, std::map<std::string, KnobValue>* values,
                        std::string* error);

}  // namespace etmlx
