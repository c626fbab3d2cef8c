#include "named_constant.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include <executorch/runtime/core/freeable_buffer.h>
#include <executorch/runtime/platform/log.h>
#include <mlx/allocator.h>
#include <zlib.h>

#include "dtypes.h"
#include "mapped_source.h"

namespace etmlx {

namespace mx = mlx::core;
using executorch::runtime::Error;
using executorch::runtime::FreeableBuffer;

namespace {

// Bytes checksummed per step of the copy: small enough that the copied chunk is still in cache when
// zlib reads it, so the checksum costs no second pass over memory.
constexpr size_t kChunk = size_t{1} << 18;
// A source this large, if mapped from a file, gives its copied pages back every kDropEvery bytes
// (mapped_source.h): the load then never holds a weight twice.
constexpr uint64_t kDropFrom = uint64_t{1} << 20;
constexpr uint64_t kDropEvery = uint64_t{1} << 22;

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// The exporter's key is "etmlx/w/<sha256 prefix>-<bytes>-<crc32>" (builder/weights.py): the CRC-32
// (zlib's) of the bytes as 8 lowercase hex digits. Parses it, checks <bytes> against `nbytes`; false
// (with `why` filled) for a key without a checksum or with another size.
bool key_checksum(const char* key, uint64_t nbytes, uint32_t* crc, const char** why) {
  const std::string k(key);
  const size_t last = k.rfind('-');
  if (k.rfind("etmlx/w/", 0) != 0 || last == std::string::npos || k.size() - last - 1 != 8) {
    *why = "carries no checksum (a file exported before etmlx checked its weights): re-export the model";
    return false;
  }
  uint32_t v = 0;
  for (size_t i = last + 1; i < k.size(); ++i) {
    const int d = hex_digit(k[i]);
    if (d < 0) {
      *why = "has a malformed checksum: re-export the model";
      return false;
    }
    v = (v << 4) | static_cast<uint32_t>(d);
  }
  const size_t size_dash = k.rfind('-', last - 1);
  if (size_dash == std::string::npos ||
      k.compare(size_dash + 1, last - size_dash - 1, std::to_string(nbytes)) != 0) {
    *why = "names a size other than its shape and dtype need: re-export the model";
    return false;
  }
  *crc = v;
  return true;
}

uint32_t crc32_of(const uint8_t* p, size_t n, uint32_t crc) {
  return static_cast<uint32_t>(crc32_z(crc, p, n));
}

void describe(size_t index, mx::Dtype dtype, const mx::Shape& shape, char* out, size_t cap) {
  int used = std::snprintf(out, cap, "constant %zu (%s [", index, mlx_dtype_name(dtype));
  for (size_t d = 0; d < shape.size() && used > 0 && static_cast<size_t>(used) < cap; ++d) {
    used += std::snprintf(out + used, cap - used, d ? ", %d" : "%d", shape[d]);
  }
  if (used > 0 && static_cast<size_t>(used) < cap) std::snprintf(out + used, cap - used, "])");
}

}  // namespace

bool named_constant(const executorch::runtime::NamedDataMap* named, const char* key, size_t index,
                    uint64_t nbytes, mx::Shape shape, mx::Dtype dtype, mx::array* out) {
  char what[160];
  describe(index, dtype, shape, what, sizeof what);
  if (named == nullptr) {
    // ExecuTorch passes no map when neither the .pte nor a loaded .ptd holds named data.
    ET_LOG(Error,
           "etmlx: %s: named data '%s' is not in the program or its weights file (no "
           "weights file was loaded); load the .ptd exported with this .pte",
           what, key);
    return false;
  }
  uint32_t want = 0;
  const char* why = nullptr;
  if (!key_checksum(key, nbytes, &want, &why)) {
    ET_LOG(Error, "etmlx: %s: named data '%s' %s", what, key, why);
    return false;
  }
  auto got = named->get_data(key);
  if (!got.ok()) {
    ET_LOG(Error,
           "etmlx: %s: named data '%s' is not in the program or its weights file (error "
           "0x%x); load the .ptd exported with this .pte",
           what, key, static_cast<unsigned>(got.error()));
    return false;
  }
  // FreeableBuffer is move-only; the shared_ptr lets the wrapped array keep one mapping alive.
  auto buffer = std::make_shared<FreeableBuffer>(std::move(got.get()));
  if (buffer->size() != nbytes) {
    ET_LOG(Error,
           "etmlx: %s: named data '%s' has %zu bytes but its shape and dtype need %llu "
           "(a .ptd from another export?)",
           what, key, buffer->size(), static_cast<unsigned long long>(nbytes));
    return false;
  }
  auto data = buffer->data_safe();
  if (!data.ok() || data.get() == nullptr) {
    ET_LOG(Error, "etmlx: %s: named data '%s' has no readable pointer", what, key);
    return false;
  }
  const auto* src = static_cast<const uint8_t*>(data.get());
  uint32_t crc = crc32_of(nullptr, 0, 0);
  // Metal's allocator can wrap page-aligned host memory without a copy; the CPU and CUDA allocators
  // cannot (make_buffer returns null), and MLX's array-from-pointer constructor would then copy. We
  // copy here instead, in cache-sized chunks, checksumming each chunk as it lands: the bytes checked
  // are exactly the bytes the program will read, for one pass over the mapping.
  mx::allocator::Buffer wrapped = mx::allocator::make_buffer(const_cast<uint8_t*>(src), nbytes);
  if (wrapped.ptr() != nullptr) {
    crc = crc32_of(src, nbytes, crc);
    if (crc != want) {
      mx::allocator::release(wrapped);
    } else {
      *out = mx::array(mx::allocator::Data(wrapped, [buffer](mx::allocator::Buffer b) { mx::allocator::release(b); }),
                       std::move(shape), dtype);
      return true;
    }
  } else {
    mx::allocator::Data copy = mx::allocator::malloc(nbytes);
    mx::allocator::Buffer dst_buffer = copy.buffer();
    auto* dst = static_cast<uint8_t*>(dst_buffer.raw_ptr());
    if (dst == nullptr) {
      ET_LOG(Error, "etmlx: %s: cannot allocate %llu bytes for named data '%s'", what,
             static_cast<unsigned long long>(nbytes), key);
      return false;
    }
    MappedSource source(src, nbytes >= kDropFrom ? nbytes : 0);
    for (uint64_t at = 0; at < nbytes; at += kChunk) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, nbytes - at));
      std::memcpy(dst + at, src + at, n);
      crc = crc32_of(dst + at, n, crc);
      if ((at + n) % kDropEvery == 0) source.drop_copied(at + n);
    }
    buffer->Free();  // the mapping: the program reads the copy
    if (crc == want) {
      *out = mx::array(std::move(copy), std::move(shape), dtype);
      return true;
    }
  }
  // ExecuTorch cuts a log message at 256 bytes: the key is shortened to its hash's first 16 digits.
  ET_LOG(Error,
         "etmlx: %s: weight '%.24s...' fails its checksum (crc32 %08" PRIx32 ", exported %08" PRIx32
         "): its .pte/.ptd is damaged or changed since export; restore or re-export it",
         what, key, crc, want);
  return false;
}

}  // namespace etmlx
