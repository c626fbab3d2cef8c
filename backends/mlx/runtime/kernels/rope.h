// Rotate-half rotary embedding (RopeNode; semantics in schema.fbs).
//
// rope_from_tables composes the ops the exported graph had (bit-identical to it).
// When the exporter proved the tables are cos/sin((offset[b] + l) * inv_freq),
// rope_fast runs mlx::core::fast::rope instead: one pass over x, no tables read.
// Devices with a fused kernel (Metal, CUDA) prefer it; on the CPU device
// fast::rope is itself a composition that recomputes the tables for every call,
// so there the shared tables are cheaper (measured on x [1, 8, 64, 64] float32:
// 0.80 ms for fast::rope against 0.47 ms from the tables). kernel_set.h says which.
#pragma once

#include <vector>

#include <mlx/array.h>

#include "options.h"

namespace etmlx::kernels {

// x [..., D] floating with D even; cos and sin [..., D] in x's dtype, broadcastable to x.
mlx::core::array rope_from_tables(const mlx::core::array& x, const mlx::core::array& cos,
                                  const mlx::core::array& sin);

// The CPU kernel set's rope_from_tables: one host loop for float32 x, the same bits (rope_cpu.cpp).
mlx::core::array rope_tables_cpu(const mlx::core::array& x, const mlx::core::array& cos,
                                 const mlx::core::array& sin);
// A layer's q and k rotated by the same float32 tables as one node (RopePairCpu): rope_tables_cpu's loop over
// each, the same bits, one node instead of two in a decode step. Both x float32 with the tables' last size.
std::vector<mlx::core::array> rope_tables_pair_cpu(const mlx::core::array& q, const mlx::core::array& k,
                                                   const mlx::core::array& cos, const mlx::core::array& sin);
// RopePairCpu nodes built in this process (etmlx_rope_pair_nodes, for the tests).
long long rope_pair_nodes();
// x [B, H, L, D]; offset integer, 0-d or [B]; freqs [D / 2] float32 (the inverse frequencies).
mlx::core::array rope_fast(const mlx::core::array& x, const mlx::core::array& offset, const mlx::core::array& freqs);

// `forced` (ETMLX_FAST_ROPE=1 or 0 at the program's load, options.h) overrides `preferred` (the kernel
// set's choice), so tests can run the kernel path on the CPU.
bool use_fast_rope(bool preferred, options::Forced forced);

}  // namespace etmlx::kernels
