// The rank group of a tensor-parallel program (schema.fbs Graph.ranks/rank/group_id), joined at load over MLX's
// distributed layer (mlx/distributed: ring over TCP on the CPU build, NCCL on CUDA, JACCL on macOS; the backend
// and the rank come from the environment MLX's launchers set: MLX_RANK, MLX_HOSTFILE, ...). No transport of
// our own: AllSumNode and AllGatherNode call mlx::core::distributed's collectives on this group.
#pragma once

#include <optional>
#include <string>

#include <mlx/distributed/distributed.h>

#include "dtypes.h"

namespace etmlx {

// For a one-rank program (ranks 1): true, `group` left empty, nothing joined. Otherwise joins the process's
// group and checks it is the program's: its size is `ranks`, this process's rank is the file's `rank`, and every
// rank loaded a file of the same export (the group ids are all-gathered and compared). False with a one-line
// `error` naming the mismatch.
bool join_group(const fb::Graph& graph, std::optional<mlx::core::distributed::Group>* group, std::string* error);

}  // namespace etmlx
