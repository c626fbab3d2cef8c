// A debugging check that a call builds its whole graph before anything is evaluated.
//
// With ETMLX_CHECK_LAZY=1 at a program's load (options.h) the interpreter keeps every node output of a call, and just before the
// call's one evaluation the backend counts those that are already materialised (a kernel
// evaluated part of the graph, or computed its result on the host). Both kernel sets must give 0
// (the CPU set's host loops are graph nodes, kernels/host_kernel.h). Tests read the count through
// etmlx_last_call_premature() (exported from the backend library), and check that the count can
// see a premature output through etmlx_lazy_check_control().
#pragma once

#include <cstdint>
#include <vector>

#include <mlx/array.h>

namespace etmlx {

// Records the count for the call that wrote `outputs`; `seeded` are the arrays the call started
// from (inputs, constants, state), which are materialised by definition and not counted.
void record_premature(const std::vector<mlx::core::array>& outputs, const std::vector<mlx::core::array>& seeded);

}  // namespace etmlx
