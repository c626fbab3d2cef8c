// The ExecuTorch BackendInterface of etmlx and its registration.
//
// init():    validates the blob (loader.cpp) and builds the per-method handle.
// execute(): binds ExecuTorch inputs to slots, runs the interpreter, evaluates
//            the outputs with mlx and copies them into the output tensors.
// Every mlx exception is caught here and turned into an Error + log line.
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/core/error.h>
#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/result.h>
#include <executorch/runtime/platform/log.h>
#include <mlx/ops.h>
#include <mlx/transforms.h>

#include <fstream>

#include <mlx/graph_utils.h>

#include "blob_header.h"
#include "call_profile.h"
#include "handle.h"
#include "interpreter.h"
#include "io.h"
#include "lazy_check.h"
#include "loader.h"
#include "options.h"

namespace etmlx {

namespace mx = mlx::core;
using executorch::runtime::ArrayRef;
using executorch::runtime::Backend;
using executorch::runtime::BackendExecutionContext;
using executorch::runtime::BackendInitContext;
using executorch::runtime::BackendInterface;
using executorch::runtime::CompileSpec;
using executorch::runtime::DelegateHandle;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::FreeableBuffer;
using executorch::runtime::Result;
using executorch::runtime::Span;

constexpr const char kBackendId[] = "EtmlxBackend";

namespace {

template <typename Specs>
size_t count(const Specs* specs) {
  return specs ? specs->size() : 0;
}

// Whether this call runs `p`'s plain step: it has one and the call's selecting input (a draft-verifying
// program's verify [B, G]) has size 1 along axis 1, a call without drafts.
bool runs_plain_step(const Program& p, Span<EValue*> args) {
  if (p.plain_step == nullptr || p.plain_step_when < 0) return false;
  const EValue& a = *args[static_cast<size_t>(p.plain_step_when)];
  return a.isTensor() && a.toTensor().dim() >= 2 && a.toTensor().size(1) == 1;
}

Error run(Handle& h, Span<EValue*> args) {
  CallTimer timer;
  const size_t n_args = count(h.program.graph->inputs());  // ExecuTorch passes the program's inputs
  const size_t n_out = count(h.program.graph->outputs());
  if (args.size() != n_args + n_out) {
    ET_LOG(Error, "etmlx: execute got %zu arguments but the graph has %zu inputs and %zu outputs",
           args.size(), n_args, n_out);
    return Error::InvalidArgument;
  }
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == nullptr) {
      ET_LOG(Error, "etmlx: argument %zu is null", i);
      return Error::InvalidArgument;
    }
  }
  // A call without drafts runs the program's plain step when it has one (loader.h): same inputs, outputs and
  // state, fewer instructions.
  const Program& prog = runs_plain_step(h.program, args) ? *h.program.plain_step : h.program;
  const fb::Graph& g = *prog.graph;
  const size_t n_in = count(g.inputs());

  if (h.state_lost) {
    ET_LOG(Error, "etmlx: an earlier call failed while evaluating its graph, so the program's state "
                  "(KV cache) is lost: load the program again");
    return Error::InvalidState;
  }
  // A program with state copies its inputs: the state's evaluation may outlive this call, and the
  // caller may reuse its input memory as soon as execute returns.
  const bool copy_inputs = !prog.mutable_slots.empty();

  Interpreter interp(prog);
  auto& tensors = interp.tensors();
  auto& values = interp.values();

  for (size_t i = 0; i < prog.constants.size(); ++i) {
    tensors[prog.constant_slots[i]] = prog.constants[i];
  }
  for (size_t j = 0; j < prog.mutable_slots.size(); ++j) {
    tensors[prog.mutable_slots[j]] = h.state[j];
  }

  // Inputs. Without copy_inputs the wrappers alias ExecuTorch memory; they stay referenced here
  // until the outputs are evaluated and copied out.
  std::vector<mx::array> wrappers;
  wrappers.reserve(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    const fb::IoSpec* spec = g.inputs()->Get(static_cast<flatbuffers::uoffset_t>(i));
    const fb::Slot* slot = spec->slot();
    const size_t from = prog.input_from.empty() ? i : prog.input_from[i];  // the argument it reads
    const EValue& arg = *args[from];
    if (slot->kind() == fb::SlotKind::Value) {
      if (!arg.isInt()) {
        ET_LOG(Error, "etmlx: input %zu must be an int (symbolic size), got EValue tag %d", from,
               static_cast<int>(arg.tag));
        return Error::InvalidArgument;
      }
      values[slot->idx()] = arg.toInt();
      continue;
    }
    if (!arg.isTensor()) {
      ET_LOG(Error, "etmlx: input %zu must be a tensor, got EValue tag %d", from,
             static_cast<int>(arg.tag));
      return Error::InvalidArgument;
    }
    mx::array a(0.0f);
    Error err = wrap_input(arg.toTensor(), spec->dtype(), from, copy_inputs, &a);
    if (err != Error::Ok) return err;
    wrappers.push_back(a);
    tensors[slot->idx()] = std::move(a);
  }

  try {
    if (!interp.run()) return Error::InvalidProgram;
  } catch (const std::exception& e) {
    ET_LOG(Error, "etmlx: instruction %zu (%s) failed: %s", interp.pc(), interp.node_name(),
           e.what());
    return Error::InvalidProgram;
  }

  // Outputs: check dtypes, resize the ExecuTorch tensors (shapes are known
  // before evaluation, so an oversized result is refused before computing it).
  std::vector<mx::array> outputs;
  std::vector<int> eval_index(n_out, -1);
  for (size_t i = 0; i < n_out; ++i) {
    const fb::IoSpec* spec = g.outputs()->Get(static_cast<flatbuffers::uoffset_t>(i));
    const fb::Slot* slot = spec->slot();
    EValue& arg = *args[n_args + i];
    if (slot->kind() == fb::SlotKind::Value) {
      if (!values[slot->idx()].has_value()) {
        ET_LOG(Error, "etmlx: output %zu reads value slot %u, which is never written", i,
               slot->idx());
        return Error::InvalidProgram;
      }
      if (!arg.isInt()) {
        ET_LOG(Error, "etmlx: output %zu must be an int EValue, got tag %d", i,
               static_cast<int>(arg.tag));
        return Error::InvalidArgument;
      }
      continue;
    }
    if (!tensors[slot->idx()].has_value()) {
      ET_LOG(Error, "etmlx: output %zu reads tensor slot %u, which is never written", i,
             slot->idx());
      return Error::InvalidProgram;
    }
    if (!arg.isTensor()) {
      ET_LOG(Error, "etmlx: output %zu must be a tensor, got EValue tag %d", i,
             static_cast<int>(arg.tag));
      return Error::InvalidArgument;
    }
    const mx::array& a = *tensors[slot->idx()];
    Error err = prepare_output(arg.toTensor(), a, spec->dtype(), i);
    if (err != Error::Ok) return err;
    eval_index[i] = static_cast<int>(outputs.size());
    outputs.push_back(a);  // copied out row-major whatever its layout (io.cpp copy_output)
  }
  std::vector<mx::array> new_state;
  new_state.reserve(prog.mutable_slots.size());
  for (size_t j = 0; j < prog.mutable_slots.size(); ++j) {
    const auto& s = tensors[prog.mutable_slots[j]];
    if (!s.has_value()) {
      ET_LOG(Error, "etmlx: mutable buffer %zu (tensor slot %u) was cleared", j,
             prog.mutable_slots[j]);
      return Error::InvalidProgram;
    }
    const mx::array& init = h.state[j];
    if (s->dtype() != init.dtype() || s->shape() != init.shape()) {
      ET_LOG(Error, "etmlx: mutable buffer %zu changed its dtype or shape", j);
      return Error::InvalidProgram;
    }
    new_state.push_back(*s);
  }

  if (!interp.written().empty()) {  // ETMLX_CHECK_LAZY=1
    std::vector<mx::array> seeded(wrappers);
    seeded.insert(seeded.end(), prog.constants.begin(), prog.constants.end());
    seeded.insert(seeded.end(), h.state.begin(), h.state.end());
    seeded.insert(seeded.end(), interp.host_made().begin(), interp.host_made().end());
    record_premature(interp.written(), seeded);
  }

  // Evaluation. The outputs are waited for; the new state is not: whatever only the state needs
  // (in a pipelined decoder, the whole step whose token the next call returns) goes on running
  // after execute returns, and the next call's graph builds on it. The outputs are scheduled first,
  // in an evaluation of their own, so waiting for them never waits for work queued behind them.
  // The graph now holds the only references to the old state, so an update of it (a KV-cache
  // write) can reuse its buffer instead of copying the whole cache.
  // ETMLX_DOT=FILE: the call's graph (outputs and new state) as Graphviz, overwritten by each call;
  // for counting what a decode step asks of MLX (docs/cpp-tools.md).
  if (const std::string& dot = options::process().dot_file; !dot.empty()) {
    std::vector<mx::array> roots(outputs);
    roots.insert(roots.end(), new_state.begin(), new_state.end());
    std::ofstream f(dot);
    mx::export_to_dot(f, roots);
  }
  tensors.clear();
  h.state = std::move(new_state);
  try {
    // MLX decides whether a cache write may reuse the old buffer when it schedules the write: only if
    // nothing else holds that buffer. The last call's kernels hold their inputs until their stream has
    // run past them, which can be after the token it waited for; a caller that calls again at once (the
    // C++ loop) then found the whole cache still held and copied it each step: twice the cache resident
    // and a cache-sized copy per call. Waiting for the stream here costs only the overlap of this call's
    // scheduling with the last call's tail; the outputs depend on that state anyway (decode tok/s unchanged
    // on the CPU, docs/log.md). Not on a GPU: there that overlap keeps the device busy, and it is unmeasured.
    timer.mark(CallPhase::Build);
    if (!h.state.empty() && mx::default_device() == mx::Device::cpu) mx::synchronize();  // in the submit phase
    mx::async_eval(outputs);
    mx::async_eval(h.state);
    timer.mark(CallPhase::Submit);
    mx::eval(outputs);
    timer.mark(CallPhase::Wait);
  } catch (const std::exception& e) {
    h.state_lost = !h.state.empty();
    ET_LOG(Error, "etmlx: evaluating the graph failed: %s", e.what());
    return Error::InvalidProgram;
  }

  for (size_t i = 0; i < n_out; ++i) {
    const fb::IoSpec* spec = g.outputs()->Get(static_cast<flatbuffers::uoffset_t>(i));
    EValue& arg = *args[n_args + i];
    if (spec->slot()->kind() == fb::SlotKind::Value) {
      arg = EValue(*values[spec->slot()->idx()]);
      continue;
    }
    Error err = copy_output(arg.toTensor(), outputs[eval_index[i]], i);
    if (err != Error::Ok) return err;
  }
  timer.mark(CallPhase::Copy);
  count_call();
  return Error::Ok;
}

class EtmlxBackend final : public BackendInterface {
 public:
  bool is_available() const override { return true; }

  Result<DelegateHandle*> init(BackendInitContext& context, FreeableBuffer* processed,
                               ArrayRef<CompileSpec> compile_specs) const override {
    (void)compile_specs;
    if (processed == nullptr) {
      ET_LOG(Error, "etmlx: init got no processed blob");
      return Error::InvalidArgument;
    }
    Result<const void*> data = processed->data_safe();
    if (!data.ok() || data.get() == nullptr) {
      ET_LOG(Error, "etmlx: init got an empty or non-pointer processed blob");
      return Error::InvalidArgument;
    }
    try {
      std::unique_ptr<Handle> h(new Handle());
      // Weights are named data (the .pte's segments or a .ptd), mapped rather than copied.
      Error err = load_program(data.get(), processed->size(), context.get_named_data_map(), h->program);
      if (err != Error::Ok) return err;
      h->state.reserve(h->program.mutable_initial.size());
      for (uint32_t c : h->program.mutable_initial) {
        h->state.push_back(h->program.constants[c]);
      }
      release_initial_values(h->program);
      // Everything needed later lives in the handle's private copy.
      processed->Free();
      register_handle(h.get());
      return static_cast<DelegateHandle*>(h.release());
    } catch (const std::bad_alloc&) {
      ET_LOG(Error, "etmlx: out of memory while loading the graph");
      return Error::MemoryAllocationFailed;
    } catch (const std::exception& e) {
      ET_LOG(Error, "etmlx: loading the graph failed: %s", e.what());
      return Error::InvalidProgram;
    } catch (...) {
      ET_LOG(Error, "etmlx: loading the graph failed with an unknown exception");
      return Error::Internal;
    }
  }

  Error execute(BackendExecutionContext& context, DelegateHandle* handle,
                Span<EValue*> args) const override {
    (void)context;
    if (handle == nullptr) {
      ET_LOG(Error, "etmlx: execute called without a handle");
      return Error::InvalidArgument;
    }
    try {
      Handle& h = *static_cast<Handle*>(handle);
      std::lock_guard<std::mutex> lock(h.mu);  // the host may be reading or writing the state
      return run(h, args);
    } catch (const std::bad_alloc&) {
      ET_LOG(Error, "etmlx: out of memory during execution");
      return Error::MemoryAllocationFailed;
    } catch (const std::exception& e) {
      ET_LOG(Error, "etmlx: execution failed: %s", e.what());
      return Error::Internal;
    } catch (...) {
      ET_LOG(Error, "etmlx: execution failed with an unknown exception");
      return Error::Internal;
    }
  }

  void destroy(DelegateHandle* handle) const override {
    Handle* h = static_cast<Handle*>(handle);
    if (h != nullptr) unregister_handle(h);
    delete h;
  }
};

EtmlxBackend g_backend;

const bool g_registered = [] {
  const Error err = executorch::runtime::register_backend(Backend{kBackendId, &g_backend});
  if (err != Error::Ok) {
    ET_LOG(Error, "etmlx: registering backend %s failed (error 0x%x)", kBackendId,
           static_cast<unsigned>(err));
    return false;
  }
  return true;
}();

}  // namespace
}  // namespace etmlx

extern "C" __attribute__((visibility("default"))) const char* etmlx_backend_id() {
  return etmlx::kBackendId;
}

extern "C" __attribute__((visibility("default"))) uint32_t etmlx_schema_version() {
  return etmlx::kSchemaVersion;
}

extern "C" __attribute__((visibility("default"))) bool etmlx_backend_registered() {
  return etmlx::g_registered;
}
