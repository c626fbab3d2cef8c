// The cpu kernel set's host loops as nodes of the lazy graph.
//
// A host loop (gumbel_max_cpu, filter_threshold_cpu, ...) reads its operands in host memory, so
// it can run only once they are computed. Evaluating them while the graph is built would wait
// for everything before the node, and would stop the next call's graph from being built while
// this one computes. So each loop is instead an MLX primitive: its CPU evaluation queues the loop
// on the CPU stream, behind its operands, inside the call's one evaluation. The result is
// bit-identical to running the same loop on evaluated operands, since it is the same loop.
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include <mlx/array.h>

namespace etmlx::kernels {

// Runs on the CPU stream's worker with `in` computed and `out` allocated. Every operand must be
// row-contiguous: pass it through mx::contiguous when building the graph (lazy; no copy when it
// already is).
using HostLoop = std::function<void(const std::vector<mlx::core::array>& in, mlx::core::array& out)>;

// A lazy [shape] `dtype` array computed by `loop` from `inputs`. With `may_reuse_input0`, out may
// share inputs[0]'s buffer when no one else holds it (same dtype and size), as MLX's own
// element-wise ops do; the loop then finds out.data() == in[0].data() and must not copy.
mlx::core::array host_kernel(const char* name, mlx::core::Shape shape, mlx::core::Dtype dtype,
                             std::vector<mlx::core::array> inputs, HostLoop loop, bool may_reuse_input0 = false);

// Several results of one host loop (one graph node, one dispatch): fused products of one input
// (quantized_matmul_group_cpu). The loop gets every output allocated.
using HostLoopMulti =
    std::function<void(const std::vector<mlx::core::array>& in, std::vector<mlx::core::array>& out)>;
std::vector<mlx::core::array> host_kernel_multi(const char* name, std::vector<mlx::core::Shape> shapes,
                                                mlx::core::Dtype dtype, std::vector<mlx::core::array> inputs,
                                                HostLoopMulti loop);

// The evaluated array `a`'s elements into `dst` in row-major order, read through its strides when it is a view.
void copy_row_major(const mlx::core::array& a, void* dst);

// A float32 operand's values in row-major order, read by a host loop: its own memory when it is
// row-contiguous (the usual case), else copied into `copy`. The activations stay lazy until the loop runs,
// so their layout is known only there; reading them in place saves the reshape and contiguous nodes a call
// would otherwise ask MLX for.
const float* float_rows(const mlx::core::array& x, std::vector<float>& copy);

// `a` as a row-contiguous operand of a host loop: itself when it is materialised that way (a loaded weight, a
// call's input, or state an evaluation in flight is writing), else through mx::contiguous. Each mx::contiguous is a graph node even when it copies nothing.
mlx::core::array contiguous_operand(const mlx::core::array& a);

// `a` without the lazy views over it that only regroup its elements (Reshape, Squeeze, ExpandDims): the same
// values in the same row-major order, for a loop that reads its operand flat through float_rows. The views then
// never become graph nodes.
mlx::core::array flat_source(mlx::core::array a);

// [rows] values of `a` (one value for every row, or one per row in row-major order), its dtype unchanged, made
// on the host when `a` is materialised or a lazy view (reshape, squeeze, expand, broadcast) of a materialised
// array (a call's knob input): no graph node. nullopt when it needs anything computed, or has another size. For the CPU kernel set only: on a CUDA GPU a host-made array costs more than a node (host_fold.h).
std::optional<mlx::core::array> host_rows(const mlx::core::array& a, int rows);

// dst = the row-major float array `src` of `shape` transposed by `perm`, row-major: a view op's result
// made by a fused node as its own copy (cheaper than the view's graph node for a decode step's sizes).
void transpose_copy(const float* src, const mlx::core::Shape& shape, const std::vector<int>& perm, float* dst);

}  // namespace etmlx::kernels
