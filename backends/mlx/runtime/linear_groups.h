// Quantized linears that read the same input, found once at load so a call runs them as one pass.
#pragma once

#include "loader.h"

namespace etmlx {

// On a kernel set with a grouped quantized matmul (the cpu set: kernels/quantized_matmul.h), groups
// QuantizedLinearNode instructions that name the same input slot, group size and bits and follow one
// another with no QuantizedLinearNode on another input between them (a layer's q/k/v projections; its
// gate and up projections). The instructions between may be anything: the interpreter checks, when
// the group's later members run, that their input and weight slots still hold the arrays the fused
// node was built from (Interpreter::exec_quantized_linear), and otherwise runs them on their own.
// Fills p.linear_groups / p.linear_group_of; returns the number of groups. Does nothing with
// ETMLX_FUSE_LINEARS=0 (for A/B runs and the tests comparing fused and unfused bits).
size_t plan_linear_groups(Program& p);

}  // namespace etmlx
