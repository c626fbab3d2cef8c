// Validation of an etmlx blob and construction of the immutable per-method
// program (the verified flatbuffer plus constants as mlx arrays).
//
// Nothing in the blob is trusted: load_program() checks the header, runs the
// flatbuffers verifier, then range-checks every slot index, enum and constant
// before anything else reads it. On failure it logs one "etmlx: ..." line
// naming the problem and returns an error; it never aborts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <executorch/runtime/core/error.h>
#include <executorch/runtime/core/named_data_map.h>
#include <mlx/array.h>
#include <mlx/distributed/distributed.h>

#include "dtypes.h"
#include "kernels/kernel_set.h"
#include "options.h"

namespace etmlx {

// Generous upper bounds that no real graph reaches, so that a corrupted count
// cannot make the runtime allocate gigabytes of slot tables.
constexpr uint32_t kMaxTensorSlots = 1u << 20;
constexpr uint32_t kMaxValueSlots = 1u << 20;
constexpr int kMaxRank = 16;

struct Program {
  // Aligned private copy of the flatbuffer payload: `graph` points into it and
  // constants may alias it, so the caller's buffer can be freed after init.
  std::shared_ptr<uint64_t[]> payload;
  size_t payload_size = 0;
  const fb::Graph* graph = nullptr;

  uint32_t num_tensors = 0;
  uint32_t num_values = 0;

  // constants[i] is Graph.constants[i]; constant_slots[i] its tensor slot.
  std::vector<mlx::core::array> constants;
  std::vector<uint32_t> constant_slots;

  // Mutable buffers: slot and index of the constant with the initial value.
  std::vector<uint32_t> mutable_slots;
  std::vector<uint32_t> mutable_initial;

  // How the CPU kernel set rounds the activations of quantized products: the blob's Graph.qmm_activations.
  kernels::ActivationPrecision activations = kernels::ActivationPrecision::int16;
  // The load options (ETMLX_KERNELS, ETMLX_FUSE_LINEARS, ...: options.h), read when this program loaded.
  options::LoadOptions options;
  // The kernel variants for the device the program was loaded on (kernels/kernel_set.h).
  const kernels::KernelSet* kernels = nullptr;
  // Whether its calls fold small host-known arithmetic (host_fold.h; decided by the device at load).
  bool host_fold = true;

  // Quantized linears over one input run as one node (linear_groups.h): each group, and per
  // instruction its group's index or -1 (empty when there are no groups).
  struct LinearGroup {
    std::vector<uint32_t> members;  // QuantizedLinearNode instructions, in order
    // A two-linear group followed by SiLU(first) * second (a gated MLP): the Sigmoid of the first's
    // result, its product with that result, and that product times the second's; -1 when not.
    int32_t sigmoid = -1, gate_mul = -1, up_mul = -1;
    // Per member: the ReshapeNode and TransposeNode right after it that view its result (q/k/v to
    // [B, H, L, D]), made in the same node; -1, -1 when not.
    std::vector<std::pair<int32_t, int32_t>> views;
  };
  std::vector<LinearGroup> linear_groups;
  std::vector<int32_t> linear_group_of;
  // Per BinaryNode Add instruction, the RmsNormNode right after it that normalizes its result (the
  // residual add and the next norm: one node on the CPU set), else -1; empty when there is none.
  std::vector<int32_t> norm_after_add;
  // Per RopeNode instruction, the next instruction when it is a RopeNode over the same cos, sin and offset
  // (a layer's q and k: one node on the CPU set), else -1; empty when there is none.
  std::vector<int32_t> rope_partner;
  // Whether the kernel set fuses such instructions at all (plan_linear_groups; ETMLX_FUSE_LINEARS=0: not).
  bool fuse_nodes = false;
  // The program's plain step (schema.fbs Graph.plain_step), its inputs and state matched to this program's
  // at load: run instead of this program for a call whose input `plain_step_when` has size 1 along axis 1
  // (a draft-verifying program's call without drafts). Null when the blob has none.
  std::shared_ptr<const Program> plain_step;
  int plain_step_when = -1;
  // In a plain step: for each of its inputs, the index of its program's input it reads (empty otherwise).
  // Its mutable buffers are in its program's order, so both index the same state.
  std::vector<uint32_t> input_from;
  // A tensor-parallel program's rank group (distributed_group.h), joined at load; a plain step shares its
  // program's. Empty for a one-rank program.
  std::optional<mlx::core::distributed::Group> group;
};

// `data`/`size` is the whole processed blob (16-byte header + flatbuffer).
// `named` is the program's named data (the .pte's segments and any .ptd loaded
// with it), where constants with a `key` live; null if the runtime gave none.
// Returns Error::Ok and fills `out`, or logs and returns
// DelegateInvalidCompatibility (bad magic / version) or InvalidProgram.
// `share` (loading a plain step): the program whose constants with the same named-data key are used as
// they are, not loaded again.
executorch::runtime::Error load_program(const void* data, size_t size,
                                        const executorch::runtime::NamedDataMap* named,
                                        Program& out, const Program* share = nullptr);

// Drops the constants `p`'s mutable buffers start from, once its state holds them (backend.cpp's init; a plain
// step's state is its program's): the graph reads each buffer's own slot, never its starting constant, and a kept
// one pins a KV cache's starting zeros beside the state the first call writes, the cache twice over (+1.3 GB for
// an 8B program with a 32k 4-bit cache). Each becomes a scalar of its dtype.
void release_initial_values(Program& p);

// Header-only check, usable without touching the payload.
executorch::runtime::Error check_header(const void* data, size_t size, uint64_t* payload_len);

}  // namespace etmlx
