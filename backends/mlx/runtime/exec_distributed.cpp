// The collective nodes of a tensor-parallel program (AllSumNode, AllGatherNode) and the point-to-point ones of a
// pipeline-parallel program (SendNode, RecvNode): MLX's own operations over the group the program joined at load
// (distributed_group.h). MLX picks the stream the group's backend
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

bool Interpreter::check_peer(int peer, const char* what) {
  if (!program_.group) return fail("needs the rank group of a pipeline-parallel program, and this program has none");
  const int ranks = program_.group->size();
  if (peer < 0 || peer >= ranks || peer == program_.group->rank()) {
    return fail("%s rank %d, which is not another rank of the %d-rank group", what, peer, ranks);
  }
  return true;
}

// out is x itself (MLX's send returns an array identical to x); the send happens when out is evaluated, so
// the program's outputs depend on it.
bool Interpreter::exec_send(const fb::SendNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  if (!check_peer(n.dst(), "sends to")) return false;
  return write(n.out(), mx::distributed::send(*x, n.dst(), *program_.group));
}

bool Interpreter::exec_recv(const fb::RecvNode& n) {
  const mx::array* like = read(n.like());
  if (!like) return false;
  if (!check_peer(n.src(), "receives from")) return false;
  return write(n.out(), mx::distributed::recv_like(*like, n.src(), *program_.group));
}

}  // namespace etmlx
