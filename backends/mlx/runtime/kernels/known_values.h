// Values the host already holds, read without evaluating anything.
//
// A node that wants a small integer on the host (a sort width, a key window) may read it only
// when the array is already materialised: a program input, a constant loaded at init, or mutable
// state from the previous call. Reading those costs no device round trip. Anything still lazy
// returns nullopt, and the caller takes the shape that is right for every value instead; this is
// how both kernel sets keep one evaluation per call.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <mlx/array.h>

namespace etmlx::kernels {

// The elements of an integer array that is already materialised and row-contiguous, in order;
// nullopt if it is lazy, empty, non-contiguous or not an int32/int64 array.
std::optional<std::vector<int64_t>> known_ints(const mlx::core::array& a);

// Their maximum (same conditions).
std::optional<int64_t> known_max(const mlx::core::array& a);

// True when `a` is a materialised, row-contiguous, non-empty float32 array none of whose elements is > 0
// (NaN included): every row's temperature says greedy. False when it is lazy or not such an array.
bool known_none_positive(const mlx::core::array& a);

// The one value of a materialised bool array whose elements are all equal (read through the views
// known_none_positive looks through); nullopt when it is lazy, mixed, large or not bool. A `where` on it
// is then a choice made at build time: a pipelined draft program's `deliver` (llm/decoder/pipelined_verify.py).
std::optional<bool> known_uniform_bool(const mlx::core::array& a);

// Whether `a` is a lazy view that only repeats or regroups its one input's elements (Broadcast, Reshape,
// ExpandDims, Squeeze): the reads above look through it, and host folding leaves such a view of an input to the
// interpreter, which shares it between layers.
bool is_view(const mlx::core::array& a);

}  // namespace etmlx::kernels
