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

// RoPE tables of the same value: the same slot, or two casts of one slot to one dtype (a bfloat16 model's
// exporter casts the float32 cos and sin again before each rotation; the interpreter makes such casts of a
// small array once per call, Interpreter::shared_view, so the two slots then hold one array).
bool same_table(const std::vector<std::pair<uint32_t, int32_t>>& cast_of, uint32_t a, uint32_t b) {
  if (a == b) return true;
  if (a >= cast_of.size() || b >= cast_of.size()) return false;
  return cast_of[a].first != UINT32_MAX && cast_of[a] == cast_of[b];
}

}  // namespace

size_t plan_linear_groups(Program& p) {
  p.linear_groups.clear();
  p.linear_group_of.clear();
  p.norm_after_add.clear();
  p.rope_partner.clear();
  p.fuse_nodes = false;
  if (p.kernels == nullptr || p.kernels->quantized_matmul_group == nullptr) return 0;
  if (!p.options.fuse_linears) return 0;  // ETMLX_FUSE_LINEARS=0: the instructions one by one (tests' reference)
  const auto* instrs = p.graph->instructions();
  if (instrs == nullptr) return 0;
  p.fuse_nodes = true;
  p.linear_group_of.assign(instrs->size(), -1);
  p.norm_after_add.assign(instrs->size(), -1);
  p.rope_partner.assign(instrs->size(), -1);
  bool any_norm = false, any_rope = false;
  std::vector<std::pair<uint32_t, int32_t>> cast_of;  // by slot: the slot and dtype an AsType made it from
  for (flatbuffers::uoffset_t i = 0; i < instrs->size(); ++i) {
    const fb::AsTypeNode* c = instrs->Get(i) ? instrs->Get(i)->node_as_AsTypeNode() : nullptr;
    if (c == nullptr || c->out() == nullptr || c->x() == nullptr) continue;
    if (c->out()->idx() >= cast_of.size()) cast_of.resize(c->out()->idx() + 1, {UINT32_MAX, -1});
    cast_of[c->out()->idx()] = {c->x()->idx(), static_cast<int32_t>(c->dtype())};
  }
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
    if (const fb::RopeNode* q = instr->node_as_RopeNode(); q && q->out()) {
      // k's rotation follows q's, with at most the casts of k's tables between them.
      uint32_t j = i + 1;
      while (j < instrs->size() && j <= i + 4 && instrs->Get(j) && instrs->Get(j)->node_as_AsTypeNode()) ++j;
      const fb::RopeNode* k = j < instrs->size() && instrs->Get(j) ? instrs->Get(j)->node_as_RopeNode() : nullptr;
      if (k && k->out() && slot(k->offset()) == slot(q->offset()) && slot(k->x()) != q->out()->idx()) {
        if (same_table(cast_of, slot(q->cos()), slot(k->cos())) && same_table(cast_of, slot(q->sin()), slot(k->sin()))) {
          p.rope_partner[i] = static_cast<int32_t>(j), any_rope = true;
        }
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
