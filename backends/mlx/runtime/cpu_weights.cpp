#include "cpu_weights.h"

#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include <mlx/ops.h>
#include <mlx/transforms.h>

namespace etmlx {

namespace mx = mlx::core;

namespace {

// Every tensor slot an instruction names, with its field ("MatmulNode.b"). The per-node switch is
// the loader's generated slot_checks.inc, whose checks have already passed when this runs.
class SlotUses {
 public:
  struct Use {
    uint32_t slot;
    std::string_view field;
  };

  const std::vector<Use>& of(const fb::Instruction& instr) {
    uses_.clear();
    collect(instr);
    return uses_;
  }

 private:
  bool collect(const fb::Instruction& instr) {
#include "slot_checks.inc"
  }
  bool tensor(const fb::Tid* t, const char* what) {
    if (t != nullptr) uses_.push_back({t->idx(), what});
    return true;
  }
  bool tensors(const flatbuffers::Vector<const fb::Tid*>* ts, const char* what) {
    if (ts != nullptr) {
      for (flatbuffers::uoffset_t i = 0; i < ts->size(); ++i) tensor(ts->Get(i), what);
    }
    return true;
  }
  bool value(const fb::Vid*, const char*) { return true; }
  bool int_or_vid(const fb::IntOrVid*, const char*) { return true; }
  bool int_or_vids(const flatbuffers::Vector<flatbuffers::Offset<fb::IntOrVid>>*, const char*) { return true; }
  bool dtype(fb::DType, const char*) { return true; }
  bool enum_in_range(int, int, const char*) { return true; }
  bool unknown_node(int) { return true; }

  std::vector<Use> uses_;
};

bool is_half(mx::Dtype t) { return t == mx::float16 || t == mx::bfloat16; }

}  // namespace

size_t widen_cpu_matmul_weights(Program& p) {
  if (p.kernels != &kernels::cpu_kernels() || p.graph->instructions() == nullptr) return 0;
  // ETMLX_CPU_WIDEN=0: keep the per-call conversion (the bits tests compare the widened weights with).
  if (!p.options.cpu_widen) return 0;
  const auto* instrs = p.graph->instructions();
  // Per slot: is it read anywhere other than as a transpose input / a product's `b`?
  std::vector<uint8_t> other_use(p.num_tensors, 0);
  std::vector<int64_t> transpose_of(p.num_tensors, -1);  // transpose output slot -> its input slot
  std::vector<uint8_t> transposes_read(p.num_tensors, 0);  // input slot read by a [1, 0] transpose
  SlotUses uses;
  for (flatbuffers::uoffset_t pc = 0; pc < instrs->size(); ++pc) {
    const fb::Instruction* instr = instrs->Get(pc);
    const auto* t = instr->node_as_TransposeNode();
    const bool swap = t != nullptr && t->perm() != nullptr && t->perm()->size() == 2 &&
                      t->perm()->Get(0) == 1 && t->perm()->Get(1) == 0;
    for (const auto& use : uses.of(*instr)) {
      const std::string_view f = use.field;
      if (f.size() >= 4 && f.substr(f.size() - 4) == ".out") {
        if (swap) transpose_of[use.slot] = t->x()->idx();
        else if (transpose_of[use.slot] >= 0) other_use[use.slot] = 1;  // written twice: leave it
        continue;
      }
      if (swap && f == "TransposeNode.x") transposes_read[use.slot] = 1;
      else if (f != "MatmulNode.b" && f != "AddmmNode.b") other_use[use.slot] = 1;
      else if (transpose_of[use.slot] < 0) other_use[use.slot] = 1;  // a product reading a constant directly
    }
  }
  // Graph outputs and state are read by the caller.
  for (const auto* specs : {p.graph->outputs(), p.graph->inputs()}) {
    if (specs == nullptr) continue;
    for (flatbuffers::uoffset_t i = 0; i < specs->size(); ++i) {
      const fb::Slot* s = specs->Get(i)->slot();
      if (s->kind() == fb::SlotKind::Tensor) other_use[s->idx()] = 1;
    }
  }
  for (uint32_t s : p.mutable_slots) other_use[s] = 1;
  std::vector<uint8_t> is_initial(p.constants.size(), 0);  // a mutable buffer's starting value keeps its dtype
  for (uint32_t c : p.mutable_initial) is_initial[c] = 1;
  // A transpose output with another use disqualifies its input.
  for (uint32_t s = 0; s < p.num_tensors; ++s) {
    if (transpose_of[s] >= 0 && other_use[s]) other_use[static_cast<uint32_t>(transpose_of[s])] = 1;
  }
  size_t widened = 0;
  for (size_t i = 0; i < p.constants.size(); ++i) {
    const uint32_t slot = p.constant_slots[i];
    mx::array& c = p.constants[i];
    if (is_initial[i] || !is_half(c.dtype()) || c.ndim() != 2 || !transposes_read[slot] || other_use[slot]) continue;
    mx::array wide = mx::astype(c, mx::float32);
    mx::eval(wide);
    c = std::move(wide);  // the half-precision array (and its mapping) is released
    ++widened;
  }
  return widened;
}

}  // namespace etmlx
