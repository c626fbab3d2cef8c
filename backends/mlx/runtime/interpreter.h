// Executes the instruction list of a verified Program on mlx arrays.
//
// The interpreter owns the per-call slot tables: one optional mlx array per
// tensor slot and one optional int64 per value slot. Every exec_<node>()
// reads its operands (an unset slot is an error, never a crash), validates
// every axis / shape argument from the blob against the actual operand
// shapes, and writes its result. mlx builds the graph lazily; nothing is
// computed until the caller evaluates the outputs. The math of the bigger nodes
// lives in kernels/ as free functions on mlx arrays; where it depends on the
// device, the variant is the one the program got at load (Program::kernels).
#pragma once

#include "host_fold.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>
#include <optional>
#include <utility>
#include <vector>

#include <mlx/array.h>

#include "loader.h"

namespace etmlx {

class Interpreter {
 public:
  explicit Interpreter(const Program& program);

  std::vector<std::optional<mlx::core::array>>& tensors() { return tensors_; }
  std::vector<std::optional<int64_t>>& values() { return values_; }

  // Runs every instruction in order. Returns false after logging on the first
  // failure. mlx exceptions propagate to the caller (which converts them).
  bool run();

  // Index and name of the instruction being run (for the caller's messages).
  size_t pc() const { return pc_; }
  const char* node_name() const { return node_name_; }

  // Every node output of the call, kept only under ETMLX_CHECK_LAZY (lazy_check.h): holding
  // them all would stop mlx from reusing intermediate buffers.
  const std::vector<mlx::core::array>& written() const { return written_; }
  // ETMLX_CHECK_LAZY=1: the arrays host folding made (host_fold.h), materialised without any evaluation.
  const std::vector<mlx::core::array>& host_made() const { return host_made_; }

 private:
  bool run_node(const fb::Instruction& instr);

  // One per union member of fb::Node (see generated/node_dispatch.inc).
  bool exec_unary(const fb::UnaryNode& n);
  bool exec_binary(const fb::BinaryNode& n);
  bool exec_where(const fb::WhereNode& n);
  bool exec_as_type(const fb::AsTypeNode& n);
  bool exec_copy(const fb::CopyNode& n);
  bool exec_full(const fb::FullNode& n);
  bool exec_arange(const fb::ArangeNode& n);
  bool exec_reduce(const fb::ReduceNode& n);
  bool exec_arg_reduce(const fb::ArgReduceNode& n);
  bool exec_softmax(const fb::SoftmaxNode& n);
  bool exec_cumsum(const fb::CumsumNode& n);
  bool exec_sort(const fb::SortNode& n);
  bool exec_argsort(const fb::ArgsortNode& n);
  bool exec_arg_partition(const fb::ArgPartitionNode& n);
  bool exec_take_along_axis(const fb::TakeAlongAxisNode& n);
  bool exec_take(const fb::TakeNode& n);
  bool exec_put_along_axis(const fb::PutAlongAxisNode& n);
  bool exec_reshape(const fb::ReshapeNode& n);
  bool exec_transpose(const fb::TransposeNode& n);
  bool exec_expand_dims(const fb::ExpandDimsNode& n);
  bool exec_squeeze(const fb::SqueezeNode& n);
  bool exec_broadcast_to(const fb::BroadcastToNode& n);
  bool exec_slice(const fb::SliceNode& n);
  bool exec_concat(const fb::ConcatNode& n);
  bool exec_matmul(const fb::MatmulNode& n);
  bool exec_addmm(const fb::AddmmNode& n);
  bool exec_sym_size(const fb::SymSizeNode& n);
  bool exec_random_bits(const fb::RandomBitsNode& n);  // exec_sampling.cpp
  bool exec_filter_threshold(const fb::FilterThresholdNode& n);  // exec_sampling.cpp
  bool exec_gumbel_max(const fb::GumbelMaxNode& n);  // exec_sampling.cpp
  bool exec_allowed_mask(const fb::AllowedMaskNode& n);  // exec_sampling.cpp
  bool exec_drawn_or_none(const fb::DrawnOrNoneNode& n);  // exec_sampling.cpp
  bool exec_sdpa(const fb::SdpaNode& n);  // exec_fused.cpp
  // A decode step's attention and the transpose and reshape right after it (back to [B, L, H * D]) as
  // one node, the views stashed for those two instructions; false when that does not apply here.
  bool sdpa_with_view(const fb::SdpaNode& n, const mlx::core::array& q, const mlx::core::array& k,
                      const mlx::core::array& v, const std::optional<mlx::core::array>& mask, int end);
  // *all_visible: the node's proven key window shows that over keys [0, end) its mask hides nothing (one
  // row, one query), so attention may run without it.
  bool sdpa_window_end(const fb::SdpaNode& n, int batch, int query_len, int keys, int* end, bool* all_visible);
  // sdpa_window_end's rule over a node's window fields (SdpaNode's, QuantizedSdpaNode's).
  bool key_window_end(bool window, const fb::Tid* window_base, int64_t shift, bool per_query, int batch,
                      int query_len, int keys, int* end, bool* all_visible);
  bool exec_quantized_sdpa(const fb::QuantizedSdpaNode& n);  // exec_fused.cpp
  bool read_attention_mask(const fb::Tid* id, mlx::core::Dtype dtype,
                           std::optional<mlx::core::array>* out);  // exec_fused.cpp
  bool exec_rms_norm(const fb::RmsNormNode& n);  // exec_fused.cpp
  bool exec_layer_norm(const fb::LayerNormNode& n);  // exec_fused.cpp
  bool exec_rope(const fb::RopeNode& n);  // exec_fused.cpp
  bool exec_conv(const fb::ConvNode& n);  // exec_spatial.cpp
  bool exec_pad(const fb::PadNode& n);  // exec_spatial.cpp
  bool exec_quantized_linear(const fb::QuantizedLinearNode& n);  // exec_quantized.cpp
  bool exec_quantized_embedding(const fb::QuantizedEmbeddingNode& n);  // exec_quantized.cpp
  // The first quantized linear of a load-time group (linear_groups.h), exec_quantized.cpp: builds every
  // member's result (and a gated MLP's SiLU product) as one node, stashing the later ones. False when
  // the group runs as separate linears (each then reports its own errors).
  bool grouped_quantized_linear(const fb::QuantizedLinearNode& n, int group);
  // A quantized linear, the residual Add right after it and that Add's RMSNorm as one node (stashing the
  // sum and the norm); false when that does not apply (the three then run as usual). exec_quantized.cpp.
  bool linear_add_rms_norm(const fb::QuantizedLinearNode& n);
  // A slot's array, or nullptr when unset, without logging (checks made for another instruction).
  const mlx::core::array* peek(const fb::Tid* t) const;
  // A quantized node's packed weights, scales and biases, read and their layout checked;
  // `columns` gets the unpacked row size (exec_quantized.cpp).
  bool read_quantized_weights(const fb::Tid* w, const fb::Tid* scales, const fb::Tid* biases, int group_size,
                              int bits, const mlx::core::array** w_out, const mlx::core::array** scales_out,
                              const mlx::core::array** biases_out, int* columns, int ndim = 2);
  bool exec_gather_mm(const fb::GatherMmNode& n);  // exec_experts.cpp
  bool exec_gather_qmm(const fb::GatherQmmNode& n);  // exec_experts.cpp
  bool exec_all_sum(const fb::AllSumNode& n);  // exec_distributed.cpp
  bool exec_all_gather(const fb::AllGatherNode& n);  // exec_distributed.cpp
  bool exec_send(const fb::SendNode& n);  // exec_distributed.cpp
  bool exec_recv(const fb::RecvNode& n);  // exec_distributed.cpp
  // A SendNode's or RecvNode's peer rank, checked against the group's ranks and this rank (exec_distributed.cpp).
  bool check_peer(int peer, const char* what);
  // An expert node's x and indices, checked against the E experts and their input features; the
  // indices clamped into [0, E) (exec_experts.cpp).
  bool read_expert_operands(const fb::Tid* x_tid, const fb::Tid* indices_tid, int experts, int in_features,
                            const mlx::core::array** x, mlx::core::array* indices);
  bool unknown_node(int type);

  // Slot access. read() returns nullptr (after logging) for an unset or
  // out-of-range slot.
  const mlx::core::array* read(const fb::Tid* t);
  bool write(const fb::Tid* t, mlx::core::array a);
  bool read_value(int64_t idx, int64_t* out);
  bool write_value(const fb::Vid* v, int64_t x);
  bool resolve(const fb::IntOrVid* iv, int64_t* out);
  bool resolve_shape(const flatbuffers::Vector<flatbuffers::Offset<fb::IntOrVid>>* v,
                     std::vector<int64_t>* out);
  // The shape of an array a node creates (full, random bits): every size in
  // [0, kMaxDim] and an element count that fits (its bytes are checked by write()).
  bool resolve_new_shape(const flatbuffers::Vector<flatbuffers::Offset<fb::IntOrVid>>* v,
                         mlx::core::Shape* shape);

  // Normalizes `axis` (negative counts from the end) against `ndim`.
  bool norm_axis(int64_t axis, int ndim, int* out, const char* what);
  // For single-axis ops: like norm_axis, but a 0-d `x` with axis 0 or -1 is
  // accepted as PyTorch does, by viewing it as shape [1] (`*scalar` set; the
  // caller reshapes its result back to 0-d).
  bool axis_operand(const mlx::core::array& x, int64_t axis, mlx::core::array* x1, int* ax,
                    bool* scalar);
  // Indices of `x` along `axis` made safe for mlx gather/scatter (which does
  // not bounds-check): integer dtype required, negative wrapped, clamped.
  bool safe_indices(const mlx::core::array& idx, int dim_size, const char* what,
                    mlx::core::array* out);
  // safe_indices' wrap-and-clamp of an integer array, made once per call per (array, axis size) and
  // pushed through the broadcasts/reshapes that `idx` is a view of.
  mlx::core::array normalized_indices(const mlx::core::array& idx, int dim_size);
  // Normalization operands (exec_fused.cpp): a floating x of rank >= 1, and an
  // optional floating weight or bias, 1-d with x's last size (absent: unset).
  bool norm_input(const fb::Tid* t, const mlx::core::array** x);
  bool norm_operand(const fb::Tid* t, const mlx::core::array& x, const char* what,
                    std::optional<mlx::core::array>* out);
  bool fail(const char* fmt, ...) __attribute__((format(printf, 2, 3)));

  const Program& program_;
  std::vector<std::optional<mlx::core::array>> tensors_;
  std::vector<std::optional<int64_t>> values_;
  size_t pc_ = 0;
  const char* node_name_ = "";
  bool keep_written_ = false;
  std::vector<mlx::core::array> written_;
  std::vector<mlx::core::array> host_made_;
  bool fold_on_ = true;  // Program::host_fold
  HostFold fold_;
  // Results a fused node made for later instructions (linear_groups.h), by instruction index, with the
  // operand slots of that instruction and the ids of the arrays the node read in their place.
  // Also the value slots the instruction reads, with the values the node used.
  struct Stashed {
    mlx::core::array out;
    std::vector<std::pair<uint32_t, std::uintptr_t>> operands;
    std::vector<std::pair<int64_t, int64_t>> values;
  };
  std::map<size_t, Stashed> stashed_;
  void stash(size_t pc, mlx::core::array out, std::vector<std::pair<uint32_t, std::uintptr_t>> operands,
             std::vector<std::pair<int64_t, int64_t>> values = {});
  // A reshape's target shape for an input of shape `in` (the value slots it read added to `values`), and
  // a transpose's permutation, resolved without logging, for views a fused node makes in advance
  // (exec_quantized.cpp): false when they do not resolve now (the instructions then run as usual).
  bool quiet_shape(const fb::ReshapeNode& r, const mlx::core::Shape& in, mlx::core::Shape* shape,
                   std::vector<std::pair<int64_t, int64_t>>* values);
  bool quiet_perm(const fb::TransposeNode& t, int ndim, std::vector<int>* perm);
  // Instruction pc_'s result from an earlier fused node, written to `out`, when its operand slots still
  // hold the arrays the node read; false otherwise (the instruction then runs on its own).
  bool take_stashed(const fb::Tid* out);
  // The residual Add at pc_ and the RMSNorm after it as one node (Program::norm_after_add); false when
  // that does not apply here (the Add then runs as usual). exec_fused.cpp.
  bool add_then_rms_norm(const fb::BinaryNode& add, const mlx::core::array& a, const mlx::core::array& b);
  // The RoPE `n` at pc_ and its partner's (Program::rope_partner) as one node; false when that does not apply
  // here (the RoPE then runs as usual). exec_fused.cpp.
  bool rope_pair(const fb::RopeNode& n, const mlx::core::array& x, const mlx::core::array& cos,
                 const mlx::core::array& sin);
  // A shape-only op's result (reshape, broadcast, expand_dims, transpose; op 4: RoPE's offset as int32; op 5:
  // a cast) of a small array (<= kMaxShared values): the one made earlier in this call for the same (op, input
  // array, arguments), or made now by `make` and kept. The exporter repeats such ops per layer over the same
  // array (RoPE's cos/sin tables, cast back to float32 before each layer's q and k in a bfloat16 model; the
  // KV-cache positions): each repeat would be another graph node, and a fresh id defeats normalized_indices
  // and the RoPE pair (rope_pair).
  static constexpr size_t kMaxShared = 4096;
  mlx::core::array shared_view(int op, const mlx::core::array& x, std::vector<int> args,
                               mlx::core::array (*make)(const mlx::core::array&, const std::vector<int>&));
  std::map<std::tuple<int, std::uintptr_t, std::vector<int>>, mlx::core::array> views_;
  // normalized_indices' results of this call, by (array id, axis size).
  // The value keeps the indices array itself too, so that its id is not reused within the call.
  std::map<std::pair<std::uintptr_t, int>, std::pair<mlx::core::array, mlx::core::array>> normalized_;
  // Arrays this call made whose every value lies in [0, bound): the token ids its samplers picked (argmax or
  // Gumbel-max over `bound` scores), by array id (the array kept, so that its id is not reused within the call).
  // Indexing with them needs no clamping where the axis has at least `bound` entries: a draft model's proposing
  // program feeds each step's token to the next step's embedding (llm/decoder/proposer.py), and the five nodes
  // that would clamp it came back in each of its K - 1 later steps.
  std::map<std::uintptr_t, std::pair<mlx::core::array, int>> bounded_;
  mlx::core::array bounded(mlx::core::array a, int bound);
};

}  // namespace etmlx
