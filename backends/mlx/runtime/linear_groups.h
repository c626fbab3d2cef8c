// Instructions that the cpu kernel set runs as one graph node, found once at load.
#pragma once

#include "loader.h"

namespace etmlx {

// On a kernel set with a grouped quantized matmul (the cpu set: kernels/quantized_matmul.h), groups
// QuantizedLinearNode instructions that name the same input slot, group size and bits and follow one
// another with no QuantizedLinearNode on another input between them (a layer's q/k/v projections; its
// gate and up projections), and marks a two-linear group's SiLU(gate) * up; it also marks each
// residual Add whose result the next instruction RMS-normalizes, and each RopeNode followed by another
// over the same tables (a layer's q and k; at most the casts of k's tables may come between them, and two casts
// of one slot to one dtype are the same table). The instructions between may be
// anything: the interpreter checks, when a later instruction of a fused node runs, that its operand
// slots still hold the arrays the node was built from (Interpreter::take_stashed), and otherwise runs
// it on its own. Fills p.linear_groups, p.linear_group_of, p.norm_after_add and p.rope_partner; returns the number of
// groups. Does nothing with ETMLX_FUSE_LINEARS=0 (for A/B runs and the tests comparing the bits).
size_t plan_linear_groups(Program& p);

}  // namespace etmlx
