// A small JSON reader for the FILE.pte.json sidecar: no dependency beyond the
// standard library, so the decode program builds wherever ExecuTorch does.
// It parses the whole grammar (RFC 8259) into a tree; numbers keep their text
// so integers are read exactly.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace etmlx::json {

struct Value {
  enum class Kind { Null, Bool, Number, String, Array, Object };
  Kind kind = Kind::Null;
  bool boolean = false;
  std::string text;  // the number's literal, or the decoded string
  std::vector<Value> items;
  std::vector<std::pair<std::string, Value>> members;

  // The member named `key`, or nullptr (also when this is not an object).
  const Value* find(const std::string& key) const;
  // The value as an exact integer; nullopt for non-integers or out of range.
  std::optional<int64_t> as_int() const;
  // Any number as a double (nearest); nullopt for non-numbers.
  std::optional<double> as_double() const;
};

// Parses `source`; on failure returns nullopt and sets `error` to a message
// with the byte offset of the problem.
std::optional<Value> parse(const std::string& source, std::string* error);

}  // namespace etmlx::json
