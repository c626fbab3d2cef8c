#include "linear_groups.h"

#include <cstdlib>
#include <cstring>

namespace etmlx {

size_t plan_linear_groups(Program& p) {
  p.linear_groups.clear();
  p.linear_group_of.clear();
  if (p.kernels == nullptr || p.kernels->quantized_matmul_group == nullptr) return 0;
  const char* env = std::getenv("ETMLX_FUSE_LINEARS");
  if (env != nullptr && std::strcmp(env, "0") == 0) return 0;
  const auto* instrs = p.graph->instructions();
  if (instrs == nullptr) return 0;
  p.linear_group_of.assign(instrs->size(), -1);
  std::vector<uint32_t> open;  // the group being collected: instruction indices
  const fb::QuantizedLinearNode* first = nullptr;
  auto close = [&] {
    if (open.size() >= 2) {
      for (uint32_t i : open) p.linear_group_of[i] = static_cast<int32_t>(p.linear_groups.size());
      p.linear_groups.push_back(open);
    }
    open.clear();
    first = nullptr;
  };
  for (flatbuffers::uoffset_t i = 0; i < instrs->size(); ++i) {
    const fb::Instruction* instr = instrs->Get(i);
    const fb::QuantizedLinearNode* n = instr ? instr->node_as_QuantizedLinearNode() : nullptr;
    if (n == nullptr || n->x() == nullptr) continue;
    const bool joins = first != nullptr && first->x()->idx() == n->x()->idx() &&
                       first->group_size() == n->group_size() && first->bits() == n->bits();
    if (!joins) {
      close();
      first = n;
    }
    open.push_back(i);
  }
  close();
  if (p.linear_groups.empty()) p.linear_group_of.clear();
  return p.linear_groups.size();
}

}  // namespace etmlx
