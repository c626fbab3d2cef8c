#include "distributed_group.h"

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string_view>

#include <zlib.h>

#include <mlx/distributed/ops.h>
#include <mlx/ops.h>
#include <mlx/transforms.h>

namespace etmlx {

namespace mx = mlx::core;

namespace {

std::string format(const char* fmt, int a, int b) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, a, b);
  return buf;
}

}  // namespace

bool join_group(const fb::Graph& graph, std::optional<mx::distributed::Group>* group, std::string* error) {
  const int ranks = graph.ranks();
  const int rank = graph.rank();
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    *error = format("the program says it is rank %d of %d ranks", rank, ranks);
    return false;
  }
  if (ranks == 1) return true;
  if (!mx::distributed::is_available()) {
    *error = "this program runs on " + std::to_string(ranks) + " ranks but this MLX build has no distributed backend";
    return false;
  }
  try {
    mx::distributed::Group g = mx::distributed::init(/*strict=*/false);
    if (g.size() != ranks) {
      *error = format("this program runs on %d ranks but the process's MLX group has %d (start it with "
                      "`etmlx generate`, mlx.launch, or MLX_RANK and MLX_HOSTFILE for every rank)", ranks, g.size());
      return false;
    }
    if (g.rank() != rank) {
      *error = format("this file is rank %d's part of the program, but this process is rank %d", rank, g.rank());
      return false;
    }
    // Every rank's group id, compared here: files of two exports (same shapes, other weights) would run and
    // answer garbage. One all_gather of 4 bytes, which also proves the group's links work before the first call.
    const flatbuffers::String* id = graph.group_id();
    const std::string_view sv = id ? id->string_view() : std::string_view();
    const auto crc = static_cast<int32_t>(
        crc32(0L, reinterpret_cast<const Bytef*>(sv.data()), static_cast<uInt>(sv.size())));
    mx::array mine(&crc, {1}, mx::int32);
    mx::array all = mx::distributed::all_gather(mine, g);
    mx::eval(all);
    const int32_t* ids = all.data<int32_t>();
    for (int r = 0; r < ranks; ++r) {
      if (ids[r] != crc) {
        *error = format("rank %d loaded a file of another export than rank %d's (their group ids differ)", r, rank);
        return false;
      }
    }
    *group = g;
    return true;
  } catch (const std::exception& e) {
    *error = std::string("joining the MLX distributed group failed: ") + e.what();
    return false;
  }
}

}  // namespace etmlx
