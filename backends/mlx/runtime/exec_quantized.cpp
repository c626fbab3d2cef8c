// The quantized-weight nodes (QuantizedLinearNode, QuantizedEmbeddingNode) over MLX's affine
// packed weights, operands checked on every call (quantized_layout.h) since the kernels read the
// packed words by the sizes the scales imply. The linear runs the kernel set's quantized matmul
// (kernels/quantized_matmul.h), the embedding MLX's dequantize of the rows looked up.
#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <vector>

#include <mlx/ops.h>

#include "dtypes.h"
#include "interpreter.h"
#include "quantized_layout.h"
#include "kernels/kernel_set.h"
#include "kernels/quantized_embedding.h"
#include "size_limits.h"

namespace etmlx {

namespace mx = mlx::core;

bool Interpreter::read_quantized_weights(const fb::Tid* w, const fb::Tid* scales, const fb::Tid* biases,
                                         int group_size, int bits, const mx::array** w_out,
                                         const mx::array** scales_out, const mx::array** biases_out,
                                         int* columns, int ndim) {
  *w_out = read(w);
  if (!*w_out) return false;
  *scales_out = read(scales);
  if (!*scales_out) return false;
  *biases_out = read(biases);
  if (!*biases_out) return false;
  std::string error;
  if (!check_quantized_layout(**w_out, **scales_out, **biases_out, group_size, bits, columns, &error, ndim)) {
    return fail("%s", error.c_str());
  }
  return true;
}

const mx::array* Interpreter::peek(const fb::Tid* t) const {
  if (t == nullptr || t->idx() >= tensors_.size() || !tensors_[t->idx()].has_value()) return nullptr;
  return &*tensors_[t->idx()];
}

void Interpreter::stash(size_t pc, mx::array out, std::vector<std::pair<uint32_t, std::uintptr_t>> operands,
                        std::vector<std::pair<int64_t, int64_t>> values) {
  stashed_.insert_or_assign(pc, Stashed{std::move(out), std::move(operands), std::move(values)});
}

bool Interpreter::quiet_shape(const fb::ReshapeNode& r, const mx::Shape& in, mx::Shape* shape,
                              std::vector<std::pair<int64_t, int64_t>>* values) {
  if (r.shape() == nullptr || r.shape()->size() > static_cast<flatbuffers::uoffset_t>(kMaxRank)) return false;
  int64_t numel = 1, known = 1;
  for (int d : in) numel *= d;
  int inferred = -1;
  shape->clear();
  for (flatbuffers::uoffset_t i = 0; i < r.shape()->size(); ++i) {
    const fb::IntOrVid* iv = r.shape()->Get(i);
    if (iv == nullptr) return false;
    int64_t d = iv->literal();
    if (iv->vid() >= 0) {
      if (static_cast<uint64_t>(iv->vid()) >= values_.size() || !values_[iv->vid()].has_value()) return false;
      d = *values_[iv->vid()];
      values->push_back({iv->vid(), d});
    }
    if (d == -1 && inferred < 0) {
      inferred = static_cast<int>(i);
    } else if (d < 0 || d > kMaxDim) {
      return false;
    } else {
      known *= d;
    }
    shape->push_back(static_cast<int32_t>(d));
  }
  if (inferred >= 0) {
    if (known == 0 || numel % known != 0) return false;
    (*shape)[inferred] = static_cast<int32_t>(numel / known);
  } else if (known != numel) {
    return false;
  }
  return true;
}

bool Interpreter::quiet_perm(const fb::TransposeNode& t, int ndim, std::vector<int>* perm) {
  if (t.perm() == nullptr || t.perm()->size() != static_cast<flatbuffers::uoffset_t>(ndim)) return false;
  std::vector<bool> seen(ndim, false);
  perm->clear();
  for (flatbuffers::uoffset_t i = 0; i < t.perm()->size(); ++i) {
    int a = t.perm()->Get(i);
    if (a < 0) a += ndim;
    if (a < 0 || a >= ndim || seen[a]) return false;
    seen[a] = true;
    perm->push_back(a);
  }
  return true;
}

bool Interpreter::take_stashed(const fb::Tid* out) {
  if (stashed_.empty()) return false;
  auto it = stashed_.find(pc_);
  if (it == stashed_.end()) return false;
  Stashed s = std::move(it->second);
  stashed_.erase(it);
  for (const auto& [slot, id] : s.operands) {
    if (slot >= tensors_.size() || !tensors_[slot].has_value() || tensors_[slot]->id() != id) return false;
  }
  for (const auto& [vid, value] : s.values) {
    if (!values_[vid].has_value() || *values_[vid] != value) return false;
  }
  return write(out, std::move(s.out));
}

namespace {

uint32_t slot_of(const fb::Tid* t) { return t->idx(); }

}  // namespace

bool Interpreter::grouped_quantized_linear(const fb::QuantizedLinearNode& n, int group) {
  const Program::LinearGroup& g = program_.linear_groups[group];
  if (pc_ != g.members.front()) return false;
  // Every member's operands checked as exec_quantized_linear checks them, quietly (a member that fails
  // runs on its own at its turn and reports there); then one node for all.
  const auto* instrs = program_.graph->instructions();
  const mx::array* x = peek(n.x());
  if (x == nullptr || x->ndim() < 1) return false;
  std::vector<kernels::QuantizedLinear> linears;
  std::vector<std::vector<std::pair<uint32_t, std::uintptr_t>>> operands(g.members.size());
  std::vector<std::vector<std::pair<int64_t, int64_t>>> view_values(g.members.size());
  for (size_t i = 0; i < g.members.size(); ++i) {
    const fb::QuantizedLinearNode* m = instrs->Get(g.members[i])->node_as_QuantizedLinearNode();
    const mx::array *w = peek(m->w()), *s = peek(m->scales()), *b = peek(m->biases());
    const mx::array* bias = m->bias() ? peek(m->bias()) : nullptr;
    if (!w || !s || !b || (m->bias() && !bias)) return false;
    int k = 0;
    std::string error;
    if (!check_quantized_layout(*w, *s, *b, m->group_size(), m->bits(), &k, &error, 2) || x->shape(-1) != k ||
        b->dtype() != s->dtype() || mx::promote_types(x->dtype(), s->dtype()) != x->dtype()) {
      return false;
    }
    if (bias && (bias->ndim() != 1 || bias->shape(0) != w->shape(0))) return false;
    linears.push_back({*w, *s, *b, bias ? std::optional<mx::array>(*bias) : std::nullopt});
    operands[i] = {{slot_of(m->x()), x->id()}, {slot_of(m->w()), w->id()}, {slot_of(m->scales()), s->id()},
                   {slot_of(m->biases()), b->id()}};
    if (bias) operands[i].push_back({slot_of(m->bias()), bias->id()});
    if (i < g.views.size() && g.views[i].first >= 0) {
      mx::Shape in = x->shape();
      in.back() = w->shape(0);
      mx::Shape shape;
      std::vector<int> perm;
      std::vector<std::pair<int64_t, int64_t>> used;
      if (quiet_shape(*instrs->Get(g.views[i].first)->node_as_ReshapeNode(), in, &shape, &used) &&
          quiet_perm(*instrs->Get(g.views[i].second)->node_as_TransposeNode(), static_cast<int>(shape.size()), &perm)) {
        linears.back().view_shape = std::move(shape);
        linears.back().view_perm = std::move(perm);
        view_values[i] = std::move(used);
      }
    }
  }
  std::vector<mx::array> outs =
      program_.kernels->quantized_matmul_group(*x, linears, n.group_size(), n.bits(), g.up_mul >= 0,
                                               program_.activations);
  size_t views = 0;
  for (const auto& l : linears) views += l.view_shape ? 2 : 0;
  const bool silu = outs.size() == g.members.size() + 3 + views;
  if (outs.size() != g.members.size() + views && !silu) return false;
  // The views' copies (after the products and the SiLU results): the Reshape reads the member's result,
  // the Transpose the Reshape's.
  for (size_t i = 0, next = g.members.size() + (silu ? 3 : 0); i < linears.size(); ++i) {
    if (!linears[i].view_shape) continue;
    const auto [r, t] = g.views[i];
    const fb::ReshapeNode* rn = instrs->Get(r)->node_as_ReshapeNode();
    stash(r, outs[next], {{rn->x()->idx(), outs[i].id()}}, std::move(view_values[i]));
    stash(t, outs[next + 1], {{rn->out()->idx(), outs[next].id()}});
    next += 2;
  }
  for (size_t i = 1; i < g.members.size(); ++i) stash(g.members[i], outs[i], std::move(operands[i]));
  if (silu) {
    // SiLU(gate) * up: each instruction's operands are the slots the chain was matched on at load.
    const fb::UnaryNode* sig = instrs->Get(g.sigmoid)->node_as_UnaryNode();
    const fb::BinaryNode* gate_mul = instrs->Get(g.gate_mul)->node_as_BinaryNode();
    const fb::BinaryNode* up_mul = instrs->Get(g.up_mul)->node_as_BinaryNode();
    const mx::array &gate = outs[0], &up = outs[1], &s = outs[2], &gs = outs[3];
    auto pair = [](const fb::BinaryNode* b, const mx::array& first, const mx::array& second, uint32_t first_slot) {
      // Either operand order: a * b and b * a are the same float32 product.
      const bool same = b->a()->idx() == first_slot;
      return std::vector<std::pair<uint32_t, std::uintptr_t>>{{b->a()->idx(), same ? first.id() : second.id()},
                                                              {b->b()->idx(), same ? second.id() : first.id()}};
    };
    stash(g.sigmoid, outs[2], {{sig->x()->idx(), gate.id()}});
    stash(g.gate_mul, outs[3], pair(gate_mul, gate, s, n.out()->idx()));
    const fb::QuantizedLinearNode* up_node = instrs->Get(g.members[1])->node_as_QuantizedLinearNode();
    stash(g.up_mul, outs[4], pair(up_mul, up, gs, up_node->out()->idx()));
  }
  return write(n.out(), std::move(outs[0]));
}

bool Interpreter::linear_add_rms_norm(const fb::QuantizedLinearNode& n) {
  const auto* instrs = program_.graph->instructions();
  const fb::BinaryNode* add = instrs->Get(pc_ + 1)->node_as_BinaryNode();
  const fb::RmsNormNode* norm = instrs->Get(program_.norm_after_add[pc_ + 1])->node_as_RmsNormNode();
  if (!add || !norm || !add->a() || !add->b() || !n.out() || n.bias() != nullptr) return false;
  const uint32_t out = n.out()->idx();
  if ((add->a()->idx() == out) == (add->b()->idx() == out)) return false;  // exactly one operand is this result
  const fb::Tid* other = add->a()->idx() == out ? add->b() : add->a();
  // The linear's checks as below, quietly (a failing one runs as usual and reports there).
  const mx::array *x = peek(n.x()), *w = peek(n.w()), *s = peek(n.scales()), *b = peek(n.biases());
  const mx::array* residual = peek(other);
  if (!x || !w || !s || !b || !residual || x->ndim() < 1) return false;
  int k = 0;
  std::string error;
  if (!check_quantized_layout(*w, *s, *b, n.group_size(), n.bits(), &k, &error, 2) || x->shape(-1) != k ||
      b->dtype() != s->dtype() || mx::promote_types(x->dtype(), s->dtype()) != x->dtype()) {
    return false;
  }
  std::optional<mx::array> weight;
  std::vector<std::pair<uint32_t, std::uintptr_t>> norm_operands;
  if (norm->weight() != nullptr) {
    const mx::array* nw = peek(norm->weight());
    if (!nw) return false;
    weight = *nw;
    norm_operands.push_back({norm->weight()->idx(), nw->id()});
  }
  std::vector<mx::array> outs = kernels::quantized_matmul_add_rms_norm_cpu(*x, *w, *s, *b, n.group_size(), n.bits(),
                                                                          *residual, weight, norm->eps(),
                                                                          program_.activations);
  if (outs.size() != 3) return false;
  stash(pc_ + 1, outs[1], {{out, outs[0].id()}, {other->idx(), residual->id()}});
  norm_operands.push_back({add->out()->idx(), outs[1].id()});
  stash(program_.norm_after_add[pc_ + 1], outs[2], std::move(norm_operands));
  return write(n.out(), std::move(outs[0]));
}

bool Interpreter::exec_quantized_linear(const fb::QuantizedLinearNode& n) {
  if (take_stashed(n.out())) return true;
  if (pc_ < program_.linear_group_of.size() && program_.linear_group_of[pc_] >= 0 &&
      grouped_quantized_linear(n, program_.linear_group_of[pc_])) {
    return true;
  }
  // An output projection followed by the residual add and the next norm (Program::norm_after_add).
  if (program_.kernels == &kernels::cpu_kernels() && pc_ + 1 < program_.norm_after_add.size() &&
      program_.norm_after_add[pc_ + 1] >= 0 && linear_add_rms_norm(n)) {
    return true;
  }
  const mx::array* x = read(n.x());
  if (!x) return false;
  const mx::array *w = nullptr, *scales = nullptr, *biases = nullptr;
  int k = 0;
  if (!read_quantized_weights(n.w(), n.scales(), n.biases(), n.group_size(), n.bits(), &w, &scales, &biases, &k))
    return false;
  if (x->ndim() < 1 || x->shape(-1) != k) {
    return fail("input's last size must be the weights' %d input features", k);
  }
  if (biases->dtype() != scales->dtype()) {
    return fail("biases are %s but the scales are %s", mlx_dtype_name(biases->dtype()),
                mlx_dtype_name(scales->dtype()));
  }
  // As mx::quantized_matmul does, the product is in the promoted type of the input and the scales: float32
  // activations over bfloat16 scales (what mlx_lm.convert -q writes for a bf16 checkpoint) multiply in float32.
  const mx::Dtype compute = mx::promote_types(x->dtype(), scales->dtype());
  const mx::array input = x->dtype() == compute ? *x : mx::astype(*x, compute);
  mx::array out = program_.kernels->quantized_matmul(input, *w, *scales, *biases, n.group_size(), n.bits(),
                                                     program_.activations);
  if (n.bias()) {
    const mx::array* bias = read(n.bias());
    if (!bias) return false;
    if (bias->ndim() != 1 || bias->shape(0) != w->shape(0)) {
      return fail("bias must be 1-d with the %d output features", w->shape(0));
    }
    out = mx::add(out, mx::astype(*bias, out.dtype()));
  }
  return write(n.out(), std::move(out));
}

bool Interpreter::exec_quantized_embedding(const fb::QuantizedEmbeddingNode& n) {
  const mx::array* indices = read(n.indices());
  if (!indices) return false;
  const mx::array *w = nullptr, *scales = nullptr, *biases = nullptr;
  int d = 0;
  if (!read_quantized_weights(n.w(), n.scales(), n.biases(), n.group_size(), n.bits(), &w, &scales, &biases, &d))
    return false;
  mx::array rows = *indices;
  if (!safe_indices(*indices, w->shape(0), "indices", &rows)) return false;
  if (program_.kernels == &kernels::cpu_kernels()) {  // one host loop instead of ~45 nodes (quantized_embedding.h)
    mx::array looked_up = rows;
    if (kernels::quantized_embedding_cpu(rows, *w, *scales, *biases, n.group_size(), n.bits(), &looked_up)) {
      return write(n.out(), std::move(looked_up));
    }
  }
  // Gather the packed rows and their scales first: only the looked-up rows are dequantized.
  mx::array out = mx::dequantize(mx::take(*w, rows, 0), mx::take(*scales, rows, 0),
                                 mx::take(*biases, rows, 0), n.group_size(), n.bits(), "affine");
  return write(n.out(), std::move(out));
}

}  // namespace etmlx
