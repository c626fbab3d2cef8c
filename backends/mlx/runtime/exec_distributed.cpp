// The collective nodes of a tensor-parallel program (AllSumNode, AllGatherNode): MLX's own collectives over the
// group the program joined at load (distributed_group.h). MLX picks the stream the group's backend
// communicates on (the CPU for ring); like every node they stay lazy until the outputs are evaluated.
#include <mlx/distributed/ops.h>

#include "interpreter.h"

namespace etmlx {

namespace mx = mlx::core;

bool Interpreter::exec_all_sum(const fb::AllSumNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  if (!program_.group) return fail("needs the rank group of a tensor-parallel program, and this program has none");
  return write(n.out(), mx::distributed::all_sum(*x, *program_.group));
}

bool Interpreter::exec_all_gather(const fb::AllGatherNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  if (!program_.group) return fail("needs the rank group of a tensor-parallel program, and this program has none");
  if (x->ndim() == 0) return fail("gathers along axis 0, which a scalar does not have");
  return write(n.out(), mx::distributed::all_gather(*x, *program_.group));
}

}  // namespace etmlx
