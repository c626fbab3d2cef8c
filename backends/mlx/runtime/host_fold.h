// Small arrays computed on the host while the graph is built, when everything they need is already there.
//
// A decode step carries index arithmetic over the host's own inputs (positions from start_pos and lengths, a
// draft program's verified positions and each row's knobs spread over them): tens of nodes on arrays of a few
// elements. On a GPU each node costs the host about 4 us to encode whatever its size, and a decode step is
// bound by that host time; on the CPU each is a task on the stream. Folding them here, where the inputs are
// already materialised, takes them out of the graph: MLX then sees constants.
//
// Only exact operations are folded (integer and bool arithmetic, comparisons, selections, views, casts, an arange
// of whole numbers; float32 only where the result is exact: data movement, comparisons, add/subtract/multiply,
// such an arange below 2^24), on arrays of at most
// kMostElements elements whose inputs are materialised (never waiting on an evaluation in flight) or
// themselves foldable. Anything else is left to MLX unchanged.
//
// On by default, except for programs loaded on a CUDA GPU: there each folded array is host data that MLX's CUDA
// allocator puts in managed memory, and once its buffer cache holds device buffers of that size it moves one back
// to managed memory per array (an allocation and a synchronous copy), about 15 us each against the ~4 us a node
// costs to encode (an H200, 2026-11-27: the built-in model's plain step 1.38x faster without folding, 7 of 7
// interleaved rounds; results/gpu/2026-11-27-h200-decode-kit-host-folding.json). Metal's memory is unified, so it keeps the default.
// ETMLX_HOST_FOLD=0 turns folding off everywhere, ETMLX_HOST_FOLD=1 on everywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include <mlx/array.h>
#include <mlx/device.h>

#include "options.h"

namespace etmlx {

// A value the host holds, its elements in row-major order: bool, int32 and int64 in `ints`, float32 in `floats`.
struct HostValue {
  std::vector<int32_t> shape;
  mlx::core::Dtype dtype = mlx::core::int64;
  std::vector<int64_t> ints;
  std::vector<float> floats;
};

class HostFold {
 public:
  static constexpr size_t kMostElements = 64;

  // Whether a program loaded on `device` folds: `forced` (ETMLX_HOST_FOLD, options.h), else the default above.
  static bool enabled_on(const mlx::core::Device& device, options::Forced forced);

  // `a` as a materialised array computed on the host, or nullopt (then MLX computes it as usual).
  std::optional<mlx::core::array> fold(const mlx::core::array& a);

  // Forget what earlier calls learnt (array ids are reused once arrays are freed).
  void clear() {
    memo_.clear();
    keep_.clear();
  }

 private:
  const HostValue* value(const mlx::core::array& a, int depth);
  // By array id, for this build: each array's value, or nullopt when it cannot be folded.
  std::unordered_map<std::uintptr_t, std::optional<HostValue>> memo_;
  std::vector<mlx::core::array> keep_;  // every array memo_ names, alive until clear()
};

}  // namespace etmlx
