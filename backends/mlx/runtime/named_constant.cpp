#include "named_constant.h"

#include <cstring>
#include <memory>
#include <utility>

#include <executorch/runtime/core/freeable_buffer.h>
#include <executorch/runtime/platform/log.h>

namespace etmlx {

namespace mx = mlx::core;
using executorch::runtime::Error;
using executorch::runtime::FreeableBuffer;

bool named_constant(const executorch::runtime::NamedDataMap* named, const char* key, size_t index,
                    uint64_t nbytes, size_t itemsize, mx::Shape shape, mx::Dtype dtype, mx::array* out) {
  if (named == nullptr) {
    // ExecuTorch passes no map when neither the .pte nor a loaded .ptd holds named data.
    ET_LOG(Error,
           "etmlx: constant %zu: named data '%s' is not in the program or its weights file (no "
           "weights file was loaded); load the .ptd exported with this .pte",
           index, key);
    return false;
  }
  auto got = named->get_data(key);
  if (!got.ok()) {
    ET_LOG(Error,
           "etmlx: constant %zu: named data '%s' is not in the program or its weights file (error "
           "0x%x); load the .ptd exported with this .pte",
           index, key, static_cast<unsigned>(got.error()));
    return false;
  }
  // FreeableBuffer is move-only; the shared_ptr lets several array copies keep one mapping alive.
  auto buffer = std::make_shared<FreeableBuffer>(std::move(got.get()));
  if (buffer->size() != nbytes) {
    ET_LOG(Error,
           "etmlx: constant %zu: named data '%s' has %zu bytes but its shape and dtype need %llu "
           "(a .ptd from another export?)",
           index, key, buffer->size(), static_cast<unsigned long long>(nbytes));
    return false;
  }
  auto data = buffer->data_safe();
  if (!data.ok() || data.get() == nullptr) {
    ET_LOG(Error, "etmlx: constant %zu: named data '%s' has no readable pointer", index, key);
    return false;
  }
  const void* src = data.get();
  if (reinterpret_cast<uintptr_t>(src) % itemsize == 0) {
    // No copy: MLX reads the mapped pages in place. They are never written: the Program keeps
    // every constant referenced, so MLX never donates this buffer to an op's output.
    *out = mx::array(const_cast<void*>(src), std::move(shape), dtype, [buffer](void*) {});
    return true;
  }
  // Misaligned (an exporter that ignored the requested alignment): one copy, made at load.
  std::shared_ptr<uint64_t[]> copy(new uint64_t[(nbytes + 7) / 8]);
  std::memcpy(copy.get(), src, nbytes);
  buffer->Free();
  *out = mx::array(static_cast<void*>(copy.get()), std::move(shape), dtype, [copy](void*) {});
  return true;
}

}  // namespace etmlx
