#include "linear_groups.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace etmlx {

namespace {

uint32_t slot(const fb::Tid* t) { return t ? t->idx() : UINT32_MAX; }

// The SiLU(gate) * up chain after a two-linear group: sigmoid(g), g * sigmoid(g) (either operand order),
// then that times u, each instruction the first of its kind after the previous one, within a few
// instructions of the group (the exporter writes them together).
void find_silu_mul(const flatbuffers::Vector<flatbuffers::Offset<fb::Instruction>>* instrs, Program::LinearGroup& g) {
  if (g.members.size() != 2) return;
  const uint32_t gate = slot(instrs->Get(g.members[0])->node_as_QuantizedLinearNode()->out());
  const uint32_t up = slot(instrs->Get(g.members[1])->node_as_QuantizedLinearNode()->out());
  const uint32_t end = std::min<uint32_t>(instrs->size(), g.members[1] + 8);
  auto pair_is = [](const fb::BinaryNode* b, uint32_t x, uint32_t y) {
    return b && b->op() == fb::BinaryOp::Multiply &&
           ((slot(b->a()) == x && slot(b->b()) == y) || (slot(b->a()) == y && slot(b->b()) == x));
  };
  int32_t sig = -1, gate_mul = -1, up_mul = -1;
  uint32_t sig_out = UINT32_MAX, gate_mul_out = UINT32_MAX;
  for (uint32_t i = g.members[0] + 1; i < end; ++i) {
    const fb::Instruction* instr = instrs->Get(i);
    if (instr == nullptr) return;
    if (sig < 0) {
      const fb::UnaryNode* u = instr->node_as_UnaryNode();
      if (u && u->op() == fb::UnaryOp::Sigmoid && slot(u->x()) == gate) sig = i, sig_out = slot(u->out());
    } else if (gate_mul < 0) {
      const fb::BinaryNode* b = instr->node_as_BinaryNode();
      if (pair_is(b, gate, sig_out)) gate_mul = i, gate_mul_out = slot(b->out());
    } else if (i > g.members[1]) {
      const fb::BinaryNode* b = instr->node_as_BinaryNode();
      if (pair_is(b, gate_mul_out, up)) {
        up_mul = i;
        break;
      }
    }
  }
  if (up_mul < 0) return;
  g.sigmoid = sig, g.gate_mul = gate_mul, g.up_mul = up_mul;
}

// A member's result reshaped, then transposed, by the two instructions right after it.
std::pair<int32_t, int32_t> find_view(const flatbuffers::Vector<flatbuffers::Offset<fb::Instruction>>* instrs,
                                      uint32_t member) {
  if (member + 2 >= instrs->size() || !instrs->Get(member + 1) || !instrs->Get(member + 2)) return {-1, -1};
  const uint32_t out = slot(instrs->Get(member)->node_as_QuantizedLinearNode()->out());
  const fb::ReshapeNode* r = instrs->Get(member + 1)->node_as_ReshapeNode();
  const fb::TransposeNode* t = instrs->Get(member + 2)->node_as_TransposeNode();
  if (!r || !t || slot(r->x()) != out || !r->out() || slot(t->x()) != r->out()->idx()) return {-1, -1};
  return {static_cast<int32_t>(member + 1), static_cast<int32_t>(member + 2)};
}

}  // namespace

size_t plan_linear_groups(Program& p) {
  p.linear_groups.clear();
  p.linear_group_of.clear();
  p.norm_after_add.clear();
  p.rope_partner.clear();
  p.fuse_nodes = false;
  if (p.kernels == nullptr || p.kernels->quantized_matmul_group == nullptr) return 0;
  const char* env = std::getenv("ETMLX_FUSE_LINEARS");
  if (env != nullptr && std::strcmp(env, "0") == 0) return 0;
  const auto* instrs = p.graph->instructions();
  if (instrs == nullptr) return 0;
  p.fuse_nodes = true;
  p.linear_group_of.assign(instrs->size(), -1);
  p.norm_after_add.assign(instrs->size(), -1);
  p.rope_partner.assign(instrs->size(), -1);
  bool any_norm = false, any_rope = false;
  Program::LinearGroup open;  // the group being collected
  const fb::QuantizedLinearNode* first = nullptr;
  auto close = [&] {
    if (open.members.size() >= 2) {
      for (uint32_t i : open.members) p.linear_group_of[i] = static_cast<int32_t>(p.linear_groups.size());
      find_silu_mul(instrs, open);
      for (uint32_t i : open.members) open.views.push_back(find_view(instrs, i));
      p.linear_groups.push_back(open);
    }
    open = {};
    first = nullptr;
  };
  for (flatbuffers::uoffset_t i = 0; i < instrs->size(); ++i) {
    const fb::Instruction* instr = instrs->Get(i);
    if (instr == nullptr) continue;
    if (const fb::BinaryNode* add = instr->node_as_BinaryNode();
        add && add->op() == fb::BinaryOp::Add && add->out() && i + 1 < instrs->size() && instrs->Get(i + 1)) {
      const fb::RmsNormNode* norm = instrs->Get(i + 1)->node_as_RmsNormNode();
      if (norm && slot(norm->x()) == add->out()->idx()) p.norm_after_add[i] = static_cast<int32_t>(i + 1), any_norm = true;
    }
    if (const fb::RopeNode* q = instr->node_as_RopeNode(); q && q->out() && i + 1 < instrs->size() && instrs->Get(i + 1)) {
      const fb::RopeNode* k = instrs->Get(i + 1)->node_as_RopeNode();
      if (k && k->out() && slot(k->cos()) == slot(q->cos()) && slot(k->sin()) == slot(q->sin()) &&
          slot(k->offset()) == slot(q->offset()) && slot(k->x()) != q->out()->idx()) {
        p.rope_partner[i] = static_cast<int32_t>(i + 1), any_rope = true;
      }
    }
    const fb::QuantizedLinearNode* n = instr->node_as_QuantizedLinearNode();
    if (n == nullptr || n->x() == nullptr) continue;
    const bool joins = first != nullptr && first->x()->idx() == n->x()->idx() &&
                       first->group_size() == n->group_size() && first->bits() == n->bits();
    if (!joins) {
      close();
      first = n;
    }
    open.members.push_back(i);
  }
  close();
  if (p.linear_groups.empty()) p.linear_group_of.clear();
  if (!any_norm) p.norm_after_add.clear();
  if (!any_rope) p.rope_partner.clear();
  return p.linear_groups.size();
}

}  // namespace etmlx
