#include "loader.h"

#include "distributed_group.h"

#include "host_fold.h"
#include "cpu_weights.h"
#include "linear_groups.h"
#include "device_choice.h"
#include "named_constant.h"
#include "quantized_layout.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <executorch/runtime/platform/log.h>
#include <flatbuffers/flatbuffers.h>
#include <mlx/ops.h>
#include <mlx/transforms.h>

#include "blob_header.h"
#include "size_limits.h"

namespace etmlx {

namespace mx = mlx::core;

void release_initial_values(Program& p) {
  for (uint32_t c : p.mutable_initial) {
    mx::array& a = p.constants[c];
    a = mx::array(0, a.dtype());  // a scalar: an instruction reading it would fail on its shape, not read stale zeros
  }
}

using executorch::runtime::Error;

namespace {

uint32_t read_u32_le(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Range checks of every slot a node names. The per-node switch is generated
// from schema.fbs (slot_checks.inc) and calls the members below.
class SlotChecker {
 public:
  SlotChecker(uint32_t num_tensors, uint32_t num_values)
      : num_tensors_(num_tensors), num_values_(num_values) {}

  bool check(const fb::Instruction& instr, size_t index) {
    index_ = index;
    if (instr.node() == nullptr) {
      ET_LOG(Error, "etmlx: instruction %zu has no node", index_);
      return false;
    }
#include "slot_checks.inc"
  }

 private:
  bool tensor(const fb::Tid* t, const char* what) {
    if (t == nullptr) {
      ET_LOG(Error, "etmlx: instruction %zu: %s is missing", index_, what);
      return false;
    }
    if (t->idx() >= num_tensors_) {
      ET_LOG(Error, "etmlx: instruction %zu: %s names tensor slot %u but the graph has %u",
             index_, what, t->idx(), num_tensors_);
      return false;
    }
    return true;
  }

  bool value(const fb::Vid* v, const char* what) {
    if (v == nullptr) {
      ET_LOG(Error, "etmlx: instruction %zu: %s is missing", index_, what);
      return false;
    }
    if (v->idx() >= num_values_) {
      ET_LOG(Error, "etmlx: instruction %zu: %s names value slot %u but the graph has %u",
             index_, what, v->idx(), num_values_);
      return false;
    }
    return true;
  }

  bool tensors(const flatbuffers::Vector<const fb::Tid*>* ts, const char* what) {
    if (ts == nullptr) {
      ET_LOG(Error, "etmlx: instruction %zu: %s is missing", index_, what);
      return false;
    }
    for (flatbuffers::uoffset_t i = 0; i < ts->size(); ++i) {
      if (!tensor(ts->Get(i), what)) return false;
    }
    return true;
  }

  bool int_or_vid(const fb::IntOrVid* iv, const char* what) {
    if (iv == nullptr) {
      ET_LOG(Error, "etmlx: instruction %zu: %s is missing", index_, what);
      return false;
    }
    if (iv->vid() >= 0 && static_cast<uint32_t>(iv->vid()) >= num_values_) {
      ET_LOG(Error, "etmlx: instruction %zu: %s names value slot %d but the graph has %u",
             index_, what, iv->vid(), num_values_);
      return false;
    }
    return true;
  }

  bool int_or_vids(const flatbuffers::Vector<flatbuffers::Offset<fb::IntOrVid>>* v,
                   const char* what) {
    if (v == nullptr) {
      ET_LOG(Error, "etmlx: instruction %zu: %s is missing", index_, what);
      return false;
    }
    for (flatbuffers::uoffset_t i = 0; i < v->size(); ++i) {
      if (!int_or_vid(v->Get(i), what)) return false;
    }
    return true;
  }

  bool dtype(fb::DType d, const char* what) {
    if (!dtype_in_range(d)) {
      ET_LOG(Error, "etmlx: instruction %zu: %s has unknown dtype %d", index_, what,
             static_cast<int>(d));
      return false;
    }
    return true;
  }

  bool enum_in_range(int v, int max, const char* what) {
    if (v < 0 || v > max) {
      ET_LOG(Error, "etmlx: instruction %zu: %s has out-of-range value %d (max %d)", index_,
             what, v, max);
      return false;
    }
    return true;
  }

  bool unknown_node(int type) {
    ET_LOG(Error, "etmlx: instruction %zu: unknown node type %d (blob from a newer etmlx?)",
           index_, type);
    return false;
  }

  uint32_t num_tensors_;
  uint32_t num_values_;
  size_t index_ = 0;
};

bool check_io(const flatbuffers::Vector<flatbuffers::Offset<fb::IoSpec>>* specs,
              const char* which, uint32_t num_tensors, uint32_t num_values) {
  if (specs == nullptr) return true;
  for (flatbuffers::uoffset_t i = 0; i < specs->size(); ++i) {
    const fb::IoSpec* spec = specs->Get(i);
    if (spec == nullptr || spec->slot() == nullptr) {
      ET_LOG(Error, "etmlx: %s %u has no slot", which, i);
      return false;
    }
    const fb::Slot* slot = spec->slot();
    const int kind = static_cast<int>(slot->kind());
    if (kind < 0 || kind > static_cast<int>(fb::SlotKind::MAX)) {
      ET_LOG(Error, "etmlx: %s %u has unknown slot kind %d", which, i, kind);
      return false;
    }
    if (slot->kind() == fb::SlotKind::Tensor) {
      if (slot->idx() >= num_tensors) {
        ET_LOG(Error, "etmlx: %s %u names tensor slot %u but the graph has %u", which, i,
               slot->idx(), num_tensors);
        return false;
      }
      if (!dtype_in_range(spec->dtype())) {
        ET_LOG(Error, "etmlx: %s %u has unknown dtype %d", which, i,
               static_cast<int>(spec->dtype()));
        return false;
      }
    } else {
      if (slot->idx() >= num_values) {
        ET_LOG(Error, "etmlx: %s %u names value slot %u but the graph has %u", which, i,
               slot->idx(), num_values);
        return false;
      }
    }
  }
  return true;
}

// Builds constant `i` as an mlx array. `keep` owns the memory `data` points
// into; the array aliases it when the data is suitably aligned.
bool make_constant(const fb::Constant& c, size_t i, const std::shared_ptr<uint64_t[]>& keep,
                   const executorch::runtime::NamedDataMap* named, mx::array* out, bool unevaluated_zeros = false) {
  if (!dtype_in_range(c.dtype())) {
    ET_LOG(Error, "etmlx: constant %zu has unknown dtype %d", i, static_cast<int>(c.dtype()));
    return false;
  }
  const auto* shape = c.shape();
  const auto* data = c.data();
  if (shape == nullptr || data == nullptr) {
    ET_LOG(Error, "etmlx: constant %zu has no shape or data", i);
    return false;
  }
  // The verifier checks the alignment of a vector's length, not of its
  // elements; a builder always aligns [long] to 8, so anything else is corrupt
  // (and reading it would be a misaligned load).
  if (reinterpret_cast<uintptr_t>(shape->data()) % alignof(int64_t) != 0) {
    ET_LOG(Error, "etmlx: constant %zu has a misaligned shape vector", i);
    return false;
  }
  if (shape->size() > static_cast<flatbuffers::uoffset_t>(kMaxRank)) {
    ET_LOG(Error, "etmlx: constant %zu has rank %u (max %d)", i, shape->size(), kMaxRank);
    return false;
  }
  const size_t itemsize = dtype_itemsize(c.dtype());
  mx::Shape mshape;
  uint64_t numel = 1;
  for (flatbuffers::uoffset_t d = 0; d < shape->size(); ++d) {
    const int64_t dim = shape->Get(d);
    if (dim < 0 || dim > std::numeric_limits<int32_t>::max()) {
      ET_LOG(Error, "etmlx: constant %zu has invalid size %lld in dimension %u", i,
             static_cast<long long>(dim), d);
      return false;
    }
    mshape.push_back(static_cast<int32_t>(dim));
    if (dim != 0 && numel > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(dim)) {
      ET_LOG(Error, "etmlx: constant %zu: element count overflows", i);
      return false;
    }
    numel *= static_cast<uint64_t>(dim);
  }
  const mx::Dtype dt = *to_mlx(c.dtype());
  if (c.zeros()) {
    // Allocated here, not stored: the exporter writes all-zero state (a KV cache) this way.
    if (data->size() != 0) {
      ET_LOG(Error, "etmlx: constant %zu is marked zeros but carries %u bytes of data", i,
             data->size());
      return false;
    }
    if (itemsize != 0 && numel > max_array_bytes() / itemsize) {
      ET_LOG(Error,
             "etmlx: constant %zu: %llu elements of %zu bytes exceed the %llu bytes one array may use "
             "(physical memory; ETMLX_MAX_ARRAY_BYTES sets it)",
             i, static_cast<unsigned long long>(numel), itemsize,
             static_cast<unsigned long long>(max_array_bytes()));
      return false;
    }
    // Evaluated now: a lazy zeros would run on this (loading) thread's
    // stream, which MLX does not let another thread's call evaluate. Not a plain step's starting state,
    // which its program's arrays replace before any call (match_plain_step): that one is never allocated.
    *out = mx::zeros(mshape, dt);
    if (!unevaluated_zeros) mx::eval(*out);
    return true;
  }
  if (numel > std::numeric_limits<uint64_t>::max() / itemsize) {
    ET_LOG(Error, "etmlx: constant %zu: byte size overflows", i);
    return false;
  }
  const bool is_named = c.key() != nullptr && c.key()->size() > 0;
  if (is_named) {
    if (data->size() != 0) {
      ET_LOG(Error, "etmlx: constant %zu is named data but also carries %u inline bytes", i, data->size());
      return false;
    }
    if (numel == 0) {
      ET_LOG(Error, "etmlx: constant %zu is named data but has no elements", i);
      return false;
    }
    return named_constant(named, c.key()->c_str(), i, numel * itemsize, std::move(mshape), dt, out);
  }
  if (numel * itemsize != static_cast<uint64_t>(data->size())) {
    ET_LOG(Error,
           "etmlx: constant %zu: data has %u bytes but shape and dtype %s need %llu", i,
           data->size(), dtype_name(c.dtype()),
           static_cast<unsigned long long>(numel * itemsize));
    return false;
  }
  if (numel == 0) {
    *out = mx::zeros(mshape, dt);
    mx::eval(*out);
    return true;
  }
  const uint8_t* src = data->data();
  if (reinterpret_cast<uintptr_t>(src) % itemsize == 0) {
    // Alias the private payload copy; the deleter keeps it alive.
    *out = mx::array(const_cast<uint8_t*>(src), std::move(mshape), dt,
                     [keep](void*) {});
  } else {
    const size_t nbytes = data->size();
    std::shared_ptr<uint64_t[]> buf(new uint64_t[(nbytes + 7) / 8]);
    std::memcpy(buf.get(), src, nbytes);
    *out = mx::array(static_cast<void*>(buf.get()), std::move(mshape), dt, [buf](void*) {});
  }
  return true;
}

// Quantized nodes: bits and group size always, and the weight layout where the operands are
// constants (they always are in an exported program), so a bad blob fails at load.
bool check_quantized_constants(const Program& p) {
  const auto* instrs = p.graph->instructions();
  if (instrs == nullptr) return true;
  std::vector<int64_t> constant_of(p.num_tensors, -1);
  for (size_t i = 0; i < p.constant_slots.size(); ++i) constant_of[p.constant_slots[i]] = static_cast<int64_t>(i);
  auto check = [&](flatbuffers::uoffset_t pc, const char* kind, const fb::Tid* w, const fb::Tid* scales,
                   const fb::Tid* biases, int group_size, int bits, int ndim = 2) {
    std::string error;
    if (check_quantized_params(group_size, bits, &error)) {
      const int64_t cw = constant_of[w->idx()], cs = constant_of[scales->idx()], cb = constant_of[biases->idx()];
      if (cw < 0 || cs < 0 || cb < 0) return true;  // computed operands: checked when the node runs
      int k = 0;
      if (check_quantized_layout(p.constants[cw], p.constants[cs], p.constants[cb], group_size, bits, &k,
                                 &error, ndim)) {
        return true;
      }
    }
    ET_LOG(Error, "etmlx: instruction %u (%s): %s", pc, kind, error.c_str());
    return false;
  };
  for (flatbuffers::uoffset_t pc = 0; pc < instrs->size(); ++pc) {
    const fb::Instruction* instr = instrs->Get(pc);
    if (const auto* n = instr->node_as_QuantizedLinearNode()) {
      if (!check(pc, "QuantizedLinearNode", n->w(), n->scales(), n->biases(), n->group_size(), n->bits())) {
        return false;
      }
    } else if (const auto* n = instr->node_as_QuantizedEmbeddingNode()) {
      if (!check(pc, "QuantizedEmbeddingNode", n->w(), n->scales(), n->biases(), n->group_size(), n->bits())) {
        return false;
      }
    } else if (const auto* n = instr->node_as_GatherQmmNode()) {
      if (!check(pc, "GatherQmmNode", n->w(), n->scales(), n->biases(), n->group_size(), n->bits(), 3)) {
        return false;
      }
    }
  }
  return true;
}

// The constants of `share` that live in named data, by key (empty without `share`).
std::unordered_map<std::string_view, size_t> keyed_constants(const Program* share) {
  std::unordered_map<std::string_view, size_t> out;
  if (share == nullptr || share->graph->constants() == nullptr) return out;
  const auto* consts = share->graph->constants();
  for (flatbuffers::uoffset_t i = 0; i < consts->size(); ++i) {
    const fb::Constant* c = consts->Get(i);
    if (c->key() != nullptr && c->key()->size() > 0) out.emplace(c->key()->string_view(), i);
  }
  return out;
}

// `share`'s loaded array for `c` when `share` holds the same named data (key, dtype and shape): a plain step
// reads its program's weights instead of a second copy. Null otherwise (then `c` is loaded as usual).
const mx::array* shared_constant(const Program* share, const std::unordered_map<std::string_view, size_t>& keyed,
                                 const fb::Constant& c) {
  if (share == nullptr || c.key() == nullptr || c.key()->size() == 0) return nullptr;
  const auto it = keyed.find(c.key()->string_view());
  if (it == keyed.end()) return nullptr;
  const fb::Constant* theirs = share->graph->constants()->Get(static_cast<flatbuffers::uoffset_t>(it->second));
  if (theirs->dtype() != c.dtype() || theirs->shape() == nullptr || c.shape() == nullptr ||
      theirs->shape()->size() != c.shape()->size()) {
    return nullptr;
  }
  for (flatbuffers::uoffset_t d = 0; d < c.shape()->size(); ++d) {
    if (theirs->shape()->Get(d) != c.shape()->Get(d)) return nullptr;
  }
  return &share->constants[it->second];
}

const char* io_name(const fb::IoSpec* io) { return io->name() != nullptr ? io->name()->c_str() : ""; }

const char* buffer_name(const fb::MutableBuffer* mb) { return mb->name() != nullptr ? mb->name()->c_str() : ""; }

// Checks that `plain` takes `main`'s inputs (each by name, with the same kind and dtype), returns outputs of the
// same kinds and dtypes and keeps the same state (each buffer by name, with the same shape and dtype); then
// orders its state as `main`'s, with `main`'s initial arrays. Logs and returns false otherwise.
bool match_plain_step(const Program& main, Program& plain, int when) {
  const auto* ins = main.graph->inputs();
  const size_t n_in = ins != nullptr ? ins->size() : 0;
  if (when < 0 || static_cast<size_t>(when) >= n_in ||
      ins->Get(static_cast<flatbuffers::uoffset_t>(when))->slot()->kind() != fb::SlotKind::Tensor) {
    ET_LOG(Error, "etmlx: the plain step is selected by input %d, which is not a tensor input of the program",
           when);
    return false;
  }
  if (const auto* theirs = plain.graph->inputs()) {
    for (flatbuffers::uoffset_t k = 0; k < theirs->size(); ++k) {
      const fb::IoSpec* in = theirs->Get(k);
      size_t found = n_in, matches = 0;
      for (size_t i = 0; i < n_in && *io_name(in) != '\0'; ++i) {
        const fb::IoSpec* mine = ins->Get(static_cast<flatbuffers::uoffset_t>(i));
        if (std::strcmp(io_name(mine), io_name(in)) != 0) continue;
        ++matches;
        if (mine->slot()->kind() == in->slot()->kind() && mine->dtype() == in->dtype()) found = i;
      }
      if (matches != 1 || found == n_in) {
        ET_LOG(Error, "etmlx: the plain step's input %u (\"%s\") is not one input of the program with its dtype", k,
               io_name(in));
        return false;
      }
      plain.input_from.push_back(static_cast<uint32_t>(found));
    }
  }
  const auto* outs = main.graph->outputs();
  const auto* their_outs = plain.graph->outputs();
  const size_t n_out = outs != nullptr ? outs->size() : 0;
  if ((their_outs != nullptr ? their_outs->size() : 0) != n_out) {
    ET_LOG(Error, "etmlx: the plain step returns a different number of outputs than the program");
    return false;
  }
  for (flatbuffers::uoffset_t i = 0; i < n_out; ++i) {
    if (outs->Get(i)->slot()->kind() != their_outs->Get(i)->slot()->kind() ||
        outs->Get(i)->dtype() != their_outs->Get(i)->dtype()) {
      ET_LOG(Error, "etmlx: the plain step's output %u differs from the program's in kind or dtype", i);
      return false;
    }
  }
  const size_t n_state = main.mutable_slots.size();
  if (plain.mutable_slots.size() != n_state) {
    ET_LOG(Error, "etmlx: the plain step keeps %zu state buffers, the program %zu", plain.mutable_slots.size(),
           n_state);
    return false;
  }
  std::vector<uint32_t> slots(n_state), initial(n_state);
  std::vector<bool> taken(n_state, false);
  for (size_t j = 0; j < n_state; ++j) {
    const char* name = buffer_name(main.graph->mutable_buffers()->Get(static_cast<flatbuffers::uoffset_t>(j)));
    size_t found = n_state;
    for (size_t k = 0; k < n_state && *name != '\0'; ++k) {
      if (!taken[k] &&
          std::strcmp(buffer_name(plain.graph->mutable_buffers()->Get(static_cast<flatbuffers::uoffset_t>(k))),
                      name) == 0) {
        found = k;
        break;
      }
    }
    if (found == n_state) {
      ET_LOG(Error, "etmlx: the plain step does not keep the program's state buffer \"%s\"", name);
      return false;
    }
    const mx::array& a = main.constants[main.mutable_initial[j]];
    const mx::array& b = plain.constants[plain.mutable_initial[found]];
    if (a.shape() != b.shape() || a.dtype() != b.dtype()) {
      ET_LOG(Error, "etmlx: the plain step's state buffer \"%s\" differs from the program's in shape or dtype",
             name);
      return false;
    }
    taken[found] = true;
    slots[j] = plain.mutable_slots[found];
    initial[j] = plain.mutable_initial[found];
  }
  plain.mutable_slots = std::move(slots);
  plain.mutable_initial = std::move(initial);
  // Its state is its program's (the handle's one state): its own starting values are never read.
  release_initial_values(plain);
  return true;
}

}  // namespace

Error check_header(const void* data, size_t size, uint64_t* payload_len) {
  if (data == nullptr || size < kBlobHeaderSize) {
    ET_LOG(Error, "etmlx: blob is %zu bytes, shorter than its %zu-byte header", size,
           kBlobHeaderSize);
    return Error::DelegateInvalidCompatibility;
  }
  const auto* p = static_cast<const uint8_t*>(data);
  if (std::memcmp(p, kBlobMagic, sizeof(kBlobMagic)) != 0) {
    ET_LOG(Error, "etmlx: blob does not start with the magic \"EMLX\" (not an etmlx blob)");
    return Error::DelegateInvalidCompatibility;
  }
  const uint32_t version = read_u32_le(p + 4);
  if (version != kSchemaVersion) {
    ET_LOG(Error, "etmlx: blob schema version %u is not supported (runtime supports %u)",
           version, kSchemaVersion);
    return Error::DelegateInvalidCompatibility;
  }
  const uint64_t len = read_u64_le(p + 8);
  if (len != size - kBlobHeaderSize) {
    ET_LOG(Error, "etmlx: blob header says the payload is %llu bytes but %zu follow it",
           static_cast<unsigned long long>(len), size - kBlobHeaderSize);
    return Error::InvalidProgram;
  }
  *payload_len = len;
  return Error::Ok;
}

Error load_program(const void* data, size_t size, const executorch::runtime::NamedDataMap* named,
                   Program& out, const Program* share) {
  // First: the constants made below and the kernel set follow the default device.
  std::string device_error;
  if (!apply_device_choice(&device_error)) {
    ET_LOG(Error, "etmlx: %s", device_error.c_str());
    return Error::InvalidArgument;
  }
  options::LoadOptions load_options = options::read_load();
  if (!load_options.error.empty()) {
    ET_LOG(Error, "etmlx: %s", load_options.error.c_str());
    return Error::InvalidArgument;
  }
  uint64_t len = 0;
  Error err = check_header(data, size, &len);
  if (err != Error::Ok) return err;
  if (len < 8 || len >= FLATBUFFERS_MAX_BUFFER_SIZE) {
    ET_LOG(Error, "etmlx: payload of %llu bytes is not a valid flatbuffer size",
           static_cast<unsigned long long>(len));
    return Error::InvalidProgram;
  }
  const uint8_t* src = static_cast<const uint8_t*>(data) + kBlobHeaderSize;
  if (!fb::GraphBufferHasIdentifier(src)) {
    ET_LOG(Error, "etmlx: payload lacks the flatbuffer file identifier \"ETMX\"");
    return Error::InvalidProgram;
  }

  // Private, 8-byte aligned copy: the verifier checks alignment relative to
  // the buffer start, and scalars are then read from aligned addresses.
  std::shared_ptr<uint64_t[]> payload;
  try {
    payload.reset(new uint64_t[(len + 7) / 8]);
  } catch (const std::bad_alloc&) {
    ET_LOG(Error, "etmlx: cannot allocate %llu bytes for the graph",
           static_cast<unsigned long long>(len));
    return Error::MemoryAllocationFailed;
  }
  std::memcpy(payload.get(), src, len);
  const auto* buf = reinterpret_cast<const uint8_t*>(payload.get());

  flatbuffers::Verifier::Options opts;
  opts.max_depth = 32;
  opts.max_tables = 4u << 20;
  opts.check_alignment = true;
  opts.max_size = FLATBUFFERS_MAX_BUFFER_SIZE;
  flatbuffers::Verifier verifier(buf, static_cast<size_t>(len), opts);
  if (!fb::VerifyGraphBuffer(verifier)) {
    ET_LOG(Error, "etmlx: payload failed flatbuffer verification (corrupt or truncated blob)");
    return Error::InvalidProgram;
  }
  const fb::Graph* g = fb::GetGraph(buf);

  const uint32_t nt = g->num_tensors();
  const uint32_t nv = g->num_values();
  if (nt > kMaxTensorSlots) {
    ET_LOG(Error, "etmlx: graph declares %u tensor slots (max %u)", nt, kMaxTensorSlots);
    return Error::InvalidProgram;
  }
  if (nv > kMaxValueSlots) {
    ET_LOG(Error, "etmlx: graph declares %u value slots (max %u)", nv, kMaxValueSlots);
    return Error::InvalidProgram;
  }
  // Chosen at export (it changes the results), so read from the program, never from the process.
  kernels::ActivationPrecision activations = kernels::ActivationPrecision::int16;
  switch (g->qmm_activations()) {
    case fb::QmmActivations::Int16: activations = kernels::ActivationPrecision::int16; break;
    case fb::QmmActivations::Int8: activations = kernels::ActivationPrecision::int8; break;
    case fb::QmmActivations::Float32: activations = kernels::ActivationPrecision::float32; break;
    default:
      ET_LOG(Error, "etmlx: graph asks for quantized-product activations %d, not int16 (0), int8 (1) or float32 (2)",
             static_cast<int>(g->qmm_activations()));
      return Error::InvalidProgram;
  }
  if (!check_io(g->inputs(), "input", nt, nv) || !check_io(g->outputs(), "output", nt, nv)) {
    return Error::InvalidProgram;
  }

  if (const auto* instrs = g->instructions()) {
    SlotChecker checker(nt, nv);
    for (flatbuffers::uoffset_t i = 0; i < instrs->size(); ++i) {
      const fb::Instruction* instr = instrs->Get(i);
      if (instr == nullptr || !checker.check(*instr, i)) return Error::InvalidProgram;
    }
  }

  // Before the weights: a file of another rank or export is refused without copying them.
  std::optional<mx::distributed::Group> group;
  if (share != nullptr) {
    group = share->group;
  } else {
    std::string group_error;
    if (!join_group(*g, &group, &group_error)) {
      ET_LOG(Error, "etmlx: %s", group_error.c_str());
      return Error::InvalidProgram;
    }
  }

  Program p;
  p.group = std::move(group);
  p.payload = payload;
  p.payload_size = static_cast<size_t>(len);
  p.graph = g;
  p.num_tensors = nt;
  p.num_values = nv;
  p.activations = activations;
  p.options = std::move(load_options);

  const auto* consts = g->constants();
  const size_t nconst = consts ? consts->size() : 0;
  const std::unordered_map<std::string_view, size_t> shared = keyed_constants(share);
  // A plain step's state starts from its program's arrays (match_plain_step): its own starting zeros stay unmade.
  std::vector<bool> state_initial(nconst, false);
  if (share != nullptr && g->mutable_buffers() != nullptr) {
    for (const fb::MutableBuffer* mb : *g->mutable_buffers()) {
      if (mb != nullptr && mb->initial() < nconst) state_initial[mb->initial()] = true;
    }
  }
  try {
    p.constants.reserve(nconst);
    p.constant_slots.reserve(nconst);
    for (size_t i = 0; i < nconst; ++i) {
      const fb::Constant* c = consts->Get(static_cast<flatbuffers::uoffset_t>(i));
      if (c == nullptr) {
        ET_LOG(Error, "etmlx: constant %zu is missing", i);
        return Error::InvalidProgram;
      }
      if (c->slot() == nullptr || c->slot()->idx() >= nt) {
        ET_LOG(Error, "etmlx: constant %zu names tensor slot %u but the graph has %u", i,
               c->slot() ? c->slot()->idx() : 0u, nt);
        return Error::InvalidProgram;
      }
      mx::array arr(0.0f);
      if (const mx::array* same = shared_constant(share, shared, *c)) {
        arr = *same;
      } else if (!make_constant(*c, i, payload, named, &arr, state_initial[i])) {
        return Error::InvalidProgram;
      }
      p.constants.push_back(std::move(arr));
      p.constant_slots.push_back(c->slot()->idx());
    }
  } catch (const std::exception& e) {
    ET_LOG(Error, "etmlx: building constants failed: %s", e.what());
    return Error::InvalidProgram;
  }

  if (const auto* mbs = g->mutable_buffers()) {
    for (flatbuffers::uoffset_t i = 0; i < mbs->size(); ++i) {
      const fb::MutableBuffer* mb = mbs->Get(i);
      if (mb == nullptr || mb->slot() == nullptr) {
        ET_LOG(Error, "etmlx: mutable buffer %u has no slot", i);
        return Error::InvalidProgram;
      }
      if (mb->slot()->idx() >= nt) {
        ET_LOG(Error, "etmlx: mutable buffer %u names tensor slot %u but the graph has %u", i,
               mb->slot()->idx(), nt);
        return Error::InvalidProgram;
      }
      if (mb->initial() >= nconst) {
        ET_LOG(Error,
               "etmlx: mutable buffer %u takes its initial value from constant %u but the "
               "graph has %zu constants",
               i, mb->initial(), nconst);
        return Error::InvalidProgram;
      }
      p.mutable_slots.push_back(mb->slot()->idx());
      p.mutable_initial.push_back(mb->initial());
    }
  }

  if (!check_quantized_constants(p)) return Error::InvalidProgram;

  p.kernels = &kernels::select_kernels(mx::default_device(), p.options.kernels);
  p.host_fold = HostFold::enabled_on(mx::default_device(), p.options.host_fold);
  // Reported only when asked for (ETMLX_CPU_WIDEN=1): an unconditional line would reach every
  // `etmlx generate` user's terminal. Not for a plain step: its weights are its program's arrays, widened or not
  // there; widening them here would keep a second, float32 copy.
  if (const size_t widened = share == nullptr ? widen_cpu_matmul_weights(p) : 0;
      widened != 0 && p.options.report_widened) {
    ET_LOG(Info, "etmlx: %zu half-precision linear weights widened to float32 at load", widened);
  }

  plan_linear_groups(p);

  if (const auto* step = g->plain_step(); step != nullptr && step->size() > 0) {
    if (share != nullptr) {
      ET_LOG(Error, "etmlx: a plain step carries a plain step of its own");
      return Error::InvalidProgram;
    }
    auto plain = std::make_shared<Program>();
    err = load_program(step->data(), step->size(), named, *plain, &p);
    if (err != Error::Ok) {
      ET_LOG(Error, "etmlx: the program's plain step (above) did not load");
      return err;
    }
    if (!match_plain_step(p, *plain, g->plain_step_when())) return Error::InvalidProgram;
    p.plain_step = std::move(plain);
    p.plain_step_when = g->plain_step_when();
  }

  out = std::move(p);
  return Error::Ok;
}

}  // namespace etmlx
