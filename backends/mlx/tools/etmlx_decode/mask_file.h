// --mask-file: a precomputed allowed-token mask per decode step, for programs exported with
// `--sampler ...,mask` (etmlx_decode has no grammar engine; a caller that has one writes the rows).
//
// Text, one row per step: row k is applied to the call that samples generated token k (row 0 to
// the prefill call). A row is ceil(V/32) 32-bit words separated by spaces or commas, each a decimal
// int32/uint32 ("-1", "4294967295") or hex ("0xffffffff"); bit j of word i allows token 32 i + j
// (llguidance's and xgrammar's layout, what `Matcher.mask()` returns). Empty lines and lines starting
// with '#' are skipped. Steps past the last row are unconstrained (all ones).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace etmlx {

// Reads `path` into rows of exactly `words` words; on a bad file returns false with `error` naming
// the line.
bool read_mask_file(const std::string& path, int64_t words, std::vector<std::vector<int32_t>>* rows,
                    std::string* error);

}  // namespace etmlx
