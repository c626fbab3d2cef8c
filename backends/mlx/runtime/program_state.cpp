// The host's access to a loaded program's KV cache: read a row's first n positions into host memory,
// write them back, copy them from one row to another inside the state (a prompt cache saved to a file,
// a prefix one row holds reused by another). C functions, called through ctypes
// (backends/mlx/runtime/program_state.py).
//
// Finding the state: init() registers each handle that has mutable buffers under a fresh id and notes
// it as created by the calling thread; right after loading a method, the loader calls
// etmlx_state_claim() on the same thread to learn the ids its load created. destroy() unregisters.
//
// The KV caches are the program's rank-4 mutable buffers, [rows, kv_heads, slots, head_dim]
// (llm/decoder/kv_cache.py): axis 0 is the row, axis 2 the position. The sampler's and a pipelined
// program's state (rank <= 2) is reset or overwritten by a row's next prefill and is left alone.
// A sliding-window layer's ring buffer has fewer slots than positions, and slot p holds the latest
// position congruent to p: the functions move slots [0, n), which are positions [0, n) only while the
// row never wrapped; the Python side refuses ring programs (runtime/decode_rows.h's rules).
//
// Every function returns 0 (or a count) on success and -1 on failure, with one line in
// etmlx_state_error(); nothing here aborts or lets an exception out.
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include <mlx/allocator.h>
#include <mlx/ops.h>
#include <mlx/transforms.h>

#include "dtypes.h"
#include "handle.h"

namespace etmlx {

namespace mx = mlx::core;

namespace {

std::mutex g_mu;  // the registry; held for the whole of a state access, so destroy() waits for it
std::unordered_map<uint64_t, Handle*> g_handles;
uint64_t g_next_id = 1;
thread_local std::vector<uint64_t> t_created;
thread_local std::string t_error;

int fail(std::string message) {
  t_error = std::move(message);
  return -1;
}

// The handle `id`, or nullptr after fail(). Caller holds g_mu.
Handle* find(uint64_t id) {
  auto it = g_handles.find(id);
  if (it == g_handles.end()) {
    fail("no loaded program has state id " + std::to_string(id) + " (it was unloaded, or never had state)");
    return nullptr;
  }
  return it->second;
}

// The indices of h's KV buffers into *kv; false after fail() when there are none or the state is lost.
// Caller holds h.mu (a call replaces h.state).
bool kv_buffers(const Handle& h, std::vector<size_t>* kv) {
  if (h.state_lost) {
    fail("the program's state is lost (an earlier call failed while evaluating): load the program again");
    return false;
  }
  kv->clear();
  for (size_t j = 0; j < h.state.size(); ++j) {
    if (h.state[j].ndim() == 4) kv->push_back(j);
  }
  if (kv->empty()) {
    fail("the program has no KV cache (no [rows, heads, positions, dim] mutable buffer): not a decoder program");
    return false;
  }
  return true;
}

// Checks row and n against every KV buffer.
bool check_row(const Handle& h, const std::vector<size_t>& kv, int64_t row, int64_t n, const char* what) {
  for (size_t j : kv) {
    const mx::array& a = h.state[j];
    if (row < 0 || row >= a.shape(0)) {
      fail(std::string(what) + " " + std::to_string(row) + " is out of range: the program has " +
           std::to_string(a.shape(0)) + " rows");
      return false;
    }
    if (n < 0 || n > a.shape(2)) {
      fail("n = " + std::to_string(n) + " is beyond the cache: KV buffer " + std::to_string(j) + " holds " +
           std::to_string(a.shape(2)) + " positions");
      return false;
    }
  }
  return true;
}

mx::Shape row_shape(const mx::array& a, int64_t n) {
  return {1, a.shape(1), static_cast<int>(n), a.shape(3)};
}

uint64_t row_bytes(const mx::array& a, int64_t n) {
  return static_cast<uint64_t>(a.shape(1)) * static_cast<uint64_t>(n) * a.shape(3) * a.itemsize();
}

template <typename F>
int guarded(F&& f) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return fail("out of memory");
  } catch (const std::exception& e) {
    return fail(std::string("state access failed: ") + e.what());
  } catch (...) {
    return fail("state access failed with an unknown exception");
  }
}

}  // namespace

void register_handle(Handle* h) {
  if (h->state.empty()) return;
  std::lock_guard<std::mutex> lock(g_mu);
  h->id = g_next_id++;
  g_handles[h->id] = h;
  t_created.push_back(h->id);
}

void unregister_handle(Handle* h) {
  if (h->id == 0) return;
  std::lock_guard<std::mutex> lock(g_mu);
  g_handles.erase(h->id);
}

}  // namespace etmlx

using etmlx::fail;
using etmlx::g_mu;
using etmlx::Handle;
namespace mx = mlx::core;

#define ETMLX_EXPORT extern "C" __attribute__((visibility("default")))

ETMLX_EXPORT const char* etmlx_state_error() { return etmlx::t_error.c_str(); }

// The ids of the stateful handles this thread created since its last claim, oldest first: the code
// that loads a method claims before and after the load. Returns how many there were (only `cap` of
// them are written).
ETMLX_EXPORT int etmlx_state_claim(uint64_t* ids, int cap) {
  const int n = static_cast<int>(etmlx::t_created.size());
  for (int i = 0; i < n && i < cap && ids != nullptr; ++i) ids[i] = etmlx::t_created[i];
  etmlx::t_created.clear();
  return n;
}

// Every state access: under the registry's lock and the program's own (no call runs meanwhile), the
// handle `id` and its KV buffers' indices, then `body(h, kv)`. Returns its result, or -1 after fail().
template <typename Body>
int with_kv(uint64_t id, Body body) {
  return etmlx::guarded([&] {
    std::lock_guard<std::mutex> lock(g_mu);
    Handle* h = etmlx::find(id);
    if (h == nullptr) return -1;
    std::lock_guard<std::mutex> hold(h->mu);
    std::vector<size_t> kv;
    if (!etmlx::kv_buffers(*h, &kv)) return -1;
    return body(h, kv);
  });
}

// The number of KV buffers (-1: error).
ETMLX_EXPORT int etmlx_state_kv_buffers(uint64_t id) {
  return with_kv(id, [](Handle*, const std::vector<size_t>& kv) { return static_cast<int>(kv.size()); });
}

// KV buffer k's shape (4 values) and dtype name (a static string) into `shape` / `*dtype`.
ETMLX_EXPORT int etmlx_state_kv_info(uint64_t id, int k, int64_t* shape, const char** dtype) {
  return with_kv(id, [&](Handle* h, const std::vector<size_t>& kv) {
    if (k < 0 || static_cast<size_t>(k) >= kv.size()) {
      return fail("KV buffer " + std::to_string(k) + " is out of range: the program has " +
                  std::to_string(kv.size()));
    }
    const mx::array& a = h->state[kv[k]];
    for (int d = 0; d < 4; ++d) shape[d] = a.shape(d);
    *dtype = etmlx::mlx_dtype_name(a.dtype());
    return 0;
  });
}

// What etmlx_state_read and _write share (with_kv, then): row `row` checked against positions [0, n),
// and `size` checked to be exactly their bytes; then `body(h, kv)` unless n is 0.
template <typename Body>
int with_row_bytes(uint64_t id, int64_t row, int64_t n, uint64_t size, Body body) {
  return with_kv(id, [&](Handle* h, const std::vector<size_t>& kv) {
    if (!etmlx::check_row(*h, kv, row, n, "row")) return -1;
    uint64_t total = 0;
    for (size_t j : kv) total += etmlx::row_bytes(h->state[j], n);
    if (size != total) {
      return fail("the buffer holds " + std::to_string(size) + " bytes, " + std::to_string(total) + " expected");
    }
    return n == 0 ? 0 : body(h, kv);
  });
}

// Row `row`'s positions [0, n) of every KV buffer, in buffer order, each [heads, n, dim] row-major in
// the state's dtype, into `out` (`size` bytes: exactly their total). Waits for pending calls.
ETMLX_EXPORT int etmlx_state_read(uint64_t id, int64_t row, int64_t n, void* out, uint64_t size) {
  return with_row_bytes(id, row, n, size, [&](Handle* h, const std::vector<size_t>& kv) {
    std::vector<mx::array> parts;
    for (size_t j : kv) {
      const mx::array& a = h->state[j];
      const int r = static_cast<int>(row);
      parts.push_back(mx::contiguous(mx::slice(a, mx::Shape{r, 0, 0, 0}, mx::Shape{r + 1, a.shape(1), static_cast<int>(n), a.shape(3)})));
    }
    mx::eval(parts);
    auto* dst = static_cast<uint8_t*>(out);
    for (const mx::array& p : parts) {
      if (!p.flags().row_contiguous) return fail("a KV slice is not contiguous after evaluation");
      std::memcpy(dst, p.data<uint8_t>(), p.nbytes());
      dst += p.nbytes();
    }
    return 0;
  });
}

// The inverse of etmlx_state_read: `in` (as it lays out) becomes row `row`'s positions [0, n).
ETMLX_EXPORT int etmlx_state_write(uint64_t id, int64_t row, int64_t n, const void* in, uint64_t size) {
  return with_row_bytes(id, row, n, size, [&](Handle* h, const std::vector<size_t>& kv) {
    // Owned copies first: nothing is replaced until all of them exist.
    std::vector<mx::array> parts;
    const auto* src = static_cast<const uint8_t*>(in);
    for (size_t j : kv) {
      const mx::array& a = h->state[j];
      const uint64_t bytes = etmlx::row_bytes(a, n);
      mx::array owned(mx::allocator::malloc(bytes), etmlx::row_shape(a, n), a.dtype());
      std::memcpy(owned.data<uint8_t>(), src, bytes);
      src += bytes;
      parts.push_back(std::move(owned));
    }
    try {
      const int r = static_cast<int>(row);
      for (size_t k = 0; k < kv.size(); ++k) {
        mx::array& a = h->state[kv[k]];
        a = mx::slice_update(a, parts[k], mx::Shape{r, 0, 0, 0}, mx::Shape{r + 1, a.shape(1), static_cast<int>(n), a.shape(3)});
      }
      mx::eval(h->state);
    } catch (...) {
      h->state_lost = true;  // some buffers may be replaced already
      throw;
    }
    return 0;
  });
}

// Row `dst`'s positions [0, n) become row `src`'s, inside the state (nothing leaves the device).
ETMLX_EXPORT int etmlx_state_copy(uint64_t id, int64_t src, int64_t dst, int64_t n) {
  return with_kv(id, [&](Handle* h, const std::vector<size_t>& kv) {
    if (!etmlx::check_row(*h, kv, src, n, "source row") ||
        !etmlx::check_row(*h, kv, dst, n, "target row")) {
      return -1;
    }
    if (n == 0 || src == dst) return 0;
    try {
      const int s = static_cast<int>(src), d = static_cast<int>(dst), len = static_cast<int>(n);
      for (size_t j : kv) {
        mx::array& a = h->state[j];
        mx::array part = mx::slice(a, mx::Shape{s, 0, 0, 0}, mx::Shape{s + 1, a.shape(1), len, a.shape(3)});
        a = mx::slice_update(a, part, mx::Shape{d, 0, 0, 0}, mx::Shape{d + 1, a.shape(1), len, a.shape(3)});
      }
      mx::eval(h->state);
    } catch (...) {
      h->state_lost = true;
      throw;
    }
    return 0;
  });
}
