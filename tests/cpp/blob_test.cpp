// Drives the EtmlxBackend directly (no .pte): reads a blob file, runs
// init/execute through the registered BackendInterface, prints the outputs,
// and optionally feeds random corruptions of the blob to init/execute.
//
//   etmlx_blob_test BLOB [ARG...] [--fuzz N] [--seed S] [--repeat K] [--quiet]
//
// ARG, in the order of Graph.inputs then Graph.outputs:
//   -i DTYPE:SHAPE   input tensor, filled deterministically (see fill())
//   -v INT           input int (symbolic size)
//   -o DTYPE:SHAPE   output tensor of that shape (dynamic-bound, capacity
//                    max(numel, 4096) elements); -O for an int output
// DTYPE is one of f32 f16 bf16 i32 i64 bool u8 i8 i16 u32; SHAPE is "2,3",
// or "-" for a 0-d tensor.
//
// Printed for each output: "OUT <k> <dims or -> : <values>", values with %.17g.
// With --fuzz N, N mutated blobs (bit flips, byte writes, truncations,
// extensions, header edits) go through init and, when that succeeds,
// execute; the process must not crash (build with -DETMLX_ASAN=ON).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/exec_aten/util/scalar_type_util.h>
#include <executorch/runtime/core/memory_allocator.h>
#include <executorch/runtime/core/portable_type/tensor.h>
#include <executorch/runtime/platform/runtime.h>

using executorch::runtime::BackendExecutionContext;
using executorch::runtime::BackendInitContext;
using executorch::runtime::BackendInterface;
using executorch::runtime::CompileSpec;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::FreeableBuffer;
using executorch::runtime::MemoryAllocator;
using executorch::runtime::Span;
using executorch::runtime::etensor::ScalarType;
using executorch::runtime::etensor::Tensor;
using executorch::runtime::etensor::TensorImpl;
using executorch::runtime::TensorShapeDynamism;

extern "C" const char* etmlx_backend_id();

namespace {

struct TypeInfo {
  const char* name;
  ScalarType type;
  size_t size;
};
const TypeInfo kTypes[] = {
    {"f32", ScalarType::Float, 4}, {"f16", ScalarType::Half, 2},
    {"bf16", ScalarType::BFloat16, 2}, {"i32", ScalarType::Int, 4},
    {"i64", ScalarType::Long, 8}, {"bool", ScalarType::Bool, 1},
    {"u8", ScalarType::Byte, 1}, {"i8", ScalarType::Char, 1},
    {"i16", ScalarType::Short, 2}, {"u32", ScalarType::UInt32, 4},
};

const TypeInfo* find_type(const std::string& s) {
  for (const auto& t : kTypes)
    if (s == t.name) return &t;
  return nullptr;
}

// One ExecuTorch tensor with its own storage.
struct OwnedTensor {
  const TypeInfo* type = nullptr;
  std::vector<TensorImpl::SizesType> sizes;
  std::vector<TensorImpl::DimOrderType> dim_order;
  std::vector<TensorImpl::StridesType> strides;
  std::vector<uint8_t> data;
  std::unique_ptr<TensorImpl> impl;

  void build(const TypeInfo* t, std::vector<int32_t> shape, size_t capacity_elems,
             TensorShapeDynamism dyn) {
    type = t;
    sizes.assign(shape.begin(), shape.end());
    dim_order.resize(sizes.size());
    strides.resize(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) dim_order[i] = static_cast<uint8_t>(i);
    int32_t st = 1;
    for (size_t i = sizes.size(); i-- > 0;) {
      strides[i] = st;
      st *= sizes[i];
    }
    data.assign(capacity_elems * t->size + 8, 0);
    impl.reset(new TensorImpl(t->type, static_cast<ssize_t>(sizes.size()), sizes.data(),
                              data.data(), dim_order.data(), strides.data(), dyn));
  }
  size_t numel() const {
    size_t n = 1;
    for (auto s : sizes) n *= static_cast<size_t>(s);
    return n;
  }
};

uint16_t f32_to_f16(float f) {
  // Round-to-nearest-even conversion; inputs here are small exact values.
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0) return static_cast<uint16_t>(sign);
  if (exp <= 0) return static_cast<uint16_t>(sign);
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00);
  uint32_t h = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  if ((mant & 0x1fff) > 0x1000 || ((mant & 0x1fff) == 0x1000 && (h & 1))) ++h;
  return static_cast<uint16_t>(h);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  uint32_t x;
  if (exp == 0) {
    if (mant == 0) {
      x = sign;
    } else {
      float f = std::ldexp(static_cast<float>(mant), -24);
      return sign ? -f : f;
    }
  } else if (exp == 31) {
    x = sign | 0x7f800000u | (mant << 13);
  } else {
    x = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// Deterministic input values: v(k) = ((k * 37) % 11) - 5, scaled by 0.5 for floats.
double fill_value(size_t k, const TypeInfo* t) {
  const double base = static_cast<double>(static_cast<int64_t>((k * 37) % 11) - 5);
  switch (t->type) {
    case ScalarType::Float:
    case ScalarType::Half:
    case ScalarType::BFloat16:
      return base * 0.5;
    case ScalarType::Bool:
      return static_cast<double>(k % 2);
    case ScalarType::Byte:
    case ScalarType::UInt32:
      return base + 5;
    default:
      return base;
  }
}

void store(uint8_t* p, const TypeInfo* t, double v) {
  switch (t->type) {
    case ScalarType::Float: { float f = static_cast<float>(v); std::memcpy(p, &f, 4); break; }
    case ScalarType::Half: { uint16_t h = f32_to_f16(static_cast<float>(v)); std::memcpy(p, &h, 2); break; }
    case ScalarType::BFloat16: {
      float f = static_cast<float>(v);
      uint32_t x;
      std::memcpy(&x, &f, 4);
      uint16_t b = static_cast<uint16_t>(x >> 16);
      std::memcpy(p, &b, 2);
      break;
    }
    case ScalarType::Int: { int32_t x = static_cast<int32_t>(v); std::memcpy(p, &x, 4); break; }
    case ScalarType::Long: { int64_t x = static_cast<int64_t>(v); std::memcpy(p, &x, 8); break; }
    case ScalarType::Bool: { *p = v != 0; break; }
    case ScalarType::Byte: { *p = static_cast<uint8_t>(v); break; }
    case ScalarType::Char: { int8_t x = static_cast<int8_t>(v); std::memcpy(p, &x, 1); break; }
    case ScalarType::Short: { int16_t x = static_cast<int16_t>(v); std::memcpy(p, &x, 2); break; }
    case ScalarType::UInt32: { uint32_t x = static_cast<uint32_t>(v); std::memcpy(p, &x, 4); break; }
    default: break;
  }
}

double load(const uint8_t* p, ScalarType t) {
  switch (t) {
    case ScalarType::Float: { float f; std::memcpy(&f, p, 4); return f; }
    case ScalarType::Half: { uint16_t h; std::memcpy(&h, p, 2); return f16_to_f32(h); }
    case ScalarType::BFloat16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      uint32_t x = static_cast<uint32_t>(b) << 16;
      float f;
      std::memcpy(&f, &x, 4);
      return f;
    }
    case ScalarType::Int: { int32_t x; std::memcpy(&x, p, 4); return x; }
    case ScalarType::Long: { int64_t x; std::memcpy(&x, p, 8); return static_cast<double>(x); }
    case ScalarType::Bool: return *p ? 1 : 0;
    case ScalarType::Byte: return *p;
    case ScalarType::Char: { int8_t x; std::memcpy(&x, p, 1); return x; }
    case ScalarType::Short: { int16_t x; std::memcpy(&x, p, 2); return x; }
    case ScalarType::UInt32: { uint32_t x; std::memcpy(&x, p, 4); return x; }
    default: return NAN;
  }
}

struct ArgSpec {
  char kind;  // 'i' tensor input, 'v' int input, 'o' tensor output, 'O' int output
  const TypeInfo* type = nullptr;
  std::vector<int32_t> shape;
  int64_t value = 0;
};

bool parse_tensor_spec(const std::string& s, ArgSpec* out) {
  const auto colon = s.find(':');
  if (colon == std::string::npos) return false;
  out->type = find_type(s.substr(0, colon));
  if (!out->type) return false;
  std::string dims = s.substr(colon + 1);
  out->shape.clear();
  if (dims == "-") return true;
  size_t pos = 0;
  while (pos <= dims.size()) {
    size_t comma = dims.find(',', pos);
    if (comma == std::string::npos) comma = dims.size();
    out->shape.push_back(std::atoi(dims.substr(pos, comma - pos).c_str()));
    pos = comma + 1;
  }
  return true;
}

// Arguments for one execute() call; rebuilt for every call so that output
// tensors start at their declared shapes.
struct Args {
  std::vector<OwnedTensor> tensors;
  std::vector<EValue> values;
  std::vector<EValue*> ptrs;

  void build(const std::vector<ArgSpec>& specs) {
    tensors.clear();
    values.clear();
    ptrs.clear();
    tensors.reserve(specs.size());
    values.reserve(specs.size());
    for (const auto& s : specs) {
      if (s.kind == 'v' || s.kind == 'O') {
        values.emplace_back(static_cast<int64_t>(s.value));
        continue;
      }
      tensors.emplace_back();
      OwnedTensor& t = tensors.back();
      size_t numel = 1;
      for (auto d : s.shape) numel *= static_cast<size_t>(d);
      if (s.kind == 'i') {
        t.build(s.type, s.shape, numel, TensorShapeDynamism::STATIC);
        for (size_t k = 0; k < numel; ++k) {
          store(t.data.data() + k * s.type->size, s.type, fill_value(k, s.type));
        }
      } else {
        t.build(s.type, s.shape, numel > 4096 ? numel : 4096,
                TensorShapeDynamism::DYNAMIC_BOUND);
      }
      values.emplace_back(Tensor(t.impl.get()));
    }
    for (auto& v : values) ptrs.push_back(&v);
  }
};

void print_outputs(const std::vector<ArgSpec>& specs, Args& args) {
  int k = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].kind == 'O') {
      std::printf("OUT %d int : %lld\n", k++, static_cast<long long>(args.values[i].toInt()));
      continue;
    }
    if (specs[i].kind != 'o') continue;
    const Tensor& t = args.values[i].toTensor();
    std::printf("OUT %d ", k++);
    if (t.dim() == 0) std::printf("-");
    for (ssize_t d = 0; d < t.dim(); ++d) std::printf(d ? ",%d" : "%d", static_cast<int>(t.size(d)));
    std::printf(" :");
    const auto* p = static_cast<const uint8_t*>(t.const_data_ptr());
    for (ssize_t e = 0; e < t.numel(); ++e) {
      std::printf(" %.17g", load(p + e * t.element_size(), t.scalar_type()));
    }
    std::printf("\n");
  }
}

std::vector<uint8_t> mutate(const std::vector<uint8_t>& blob, std::mt19937_64& rng) {
  std::vector<uint8_t> b = blob;
  auto pick = [&](size_t n) { return n ? static_cast<size_t>(rng() % n) : 0; };
  const int kind = static_cast<int>(rng() % 8);
  switch (kind) {
    case 0: {  // a few bit flips anywhere
      int flips = 1 + static_cast<int>(rng() % 4);
      for (int i = 0; i < flips && !b.empty(); ++i) b[pick(b.size())] ^= 1u << (rng() % 8);
      break;
    }
    case 1: {  // one bit flip in the payload past the header
      if (b.size() > 16) b[16 + pick(b.size() - 16)] ^= 1u << (rng() % 8);
      break;
    }
    case 2: {  // random byte
      if (!b.empty()) b[pick(b.size())] = static_cast<uint8_t>(rng());
      break;
    }
    case 3: {  // truncate (header length left stale or fixed up)
      b.resize(pick(b.size()));
      if (b.size() >= 16 && (rng() & 1)) {
        uint64_t len = b.size() - 16;
        for (int i = 0; i < 8; ++i) b[8 + i] = static_cast<uint8_t>(len >> (8 * i));
      }
      break;
    }
    case 4: {  // extend with junk
      size_t extra = 1 + pick(64);
      for (size_t i = 0; i < extra; ++i) b.push_back(static_cast<uint8_t>(rng()));
      break;
    }
    case 5: {  // interesting values into a 4-byte word
      static const uint32_t vals[] = {0, 1, 0x7fffffff, 0x80000000, 0xffffffff, 0xffff, 16, 4096};
      if (b.size() >= 4) {
        size_t off = pick(b.size() - 3) & ~size_t{3};
        uint32_t v = vals[rng() % (sizeof(vals) / sizeof(vals[0]))];
        std::memcpy(&b[off], &v, 4);
      }
      break;
    }
    case 6: {  // header edits
      if (b.size() >= 16) b[pick(16)] ^= static_cast<uint8_t>(1 + rng() % 255);
      break;
    }
    default: {  // many bit flips
      int flips = 8 + static_cast<int>(rng() % 32);
      for (int i = 0; i < flips && !b.empty(); ++i) b[pick(b.size())] ^= 1u << (rng() % 8);
      break;
    }
  }
  return b;
}

struct Outcome {
  Error init = Error::Ok;
  Error exec = Error::Ok;
};

Outcome run_once(BackendInterface* backend, const std::vector<uint8_t>& blob,
                 const std::vector<ArgSpec>& specs, int repeat, bool print) {
  Outcome out;
  // The backend may Free() the buffer after init; keep our own copy separate.
  auto* copy = new std::vector<uint8_t>(blob);
  FreeableBuffer processed(
      copy->data(), copy->size(),
      [](void* ctx, void*, size_t) { delete static_cast<std::vector<uint8_t>*>(ctx); }, copy);
  alignas(16) static uint8_t arena[4096];
  MemoryAllocator allocator(sizeof(arena), arena);
  BackendInitContext init_ctx(&allocator);
  auto handle = backend->init(init_ctx, &processed, {});
  processed.Free();
  if (!handle.ok()) {
    out.init = handle.error();
    return out;
  }
  for (int r = 0; r < repeat; ++r) {
    Args args;
    args.build(specs);
    BackendExecutionContext exec_ctx;
    out.exec = backend->execute(exec_ctx, handle.get(), Span<EValue*>(args.ptrs.data(), args.ptrs.size()));
    if (out.exec != Error::Ok) break;
    if (print) print_outputs(specs, args);
  }
  backend->destroy(handle.get());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  executorch::runtime::runtime_init();
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s BLOB [-i T:S | -v N | -o T:S | -O]... [--fuzz N] [--seed S] "
                         "[--repeat K] [--quiet]\n", argv[0]);
    return 2;
  }
  std::ifstream f(argv[1], std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "cannot read %s\n", argv[1]);
    return 2;
  }
  std::vector<uint8_t> blob((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());

  std::vector<ArgSpec> specs;
  long fuzz = 0;
  uint64_t seed = 1;
  int repeat = 1;
  bool quiet = false;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "-i" || a == "-o") {
      ArgSpec s;
      s.kind = a[1];
      if (!parse_tensor_spec(next(), &s)) {
        std::fprintf(stderr, "bad tensor spec for %s\n", a.c_str());
        return 2;
      }
      specs.push_back(s);
    } else if (a == "-v") {
      ArgSpec s;
      s.kind = 'v';
      s.value = std::atoll(next().c_str());
      specs.push_back(s);
    } else if (a == "-O") {
      ArgSpec s;
      s.kind = 'O';
      specs.push_back(s);
    } else if (a == "--fuzz") {
      fuzz = std::atol(next().c_str());
    } else if (a == "--seed") {
      seed = std::strtoull(next().c_str(), nullptr, 10);
    } else if (a == "--repeat") {
      repeat = std::atoi(next().c_str());
    } else if (a == "--quiet") {
      quiet = true;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }

  BackendInterface* backend = executorch::runtime::get_backend_class(etmlx_backend_id());
  if (backend == nullptr) {
    std::fprintf(stderr, "backend %s is not registered\n", etmlx_backend_id());
    return 3;
  }

  if (fuzz == 0) {
    Outcome o = run_once(backend, blob, specs, repeat, !quiet);
    if (o.init != Error::Ok) {
      std::printf("INIT_ERROR 0x%x\n", static_cast<unsigned>(o.init));
      return 1;
    }
    if (o.exec != Error::Ok) {
      std::printf("EXEC_ERROR 0x%x\n", static_cast<unsigned>(o.exec));
      return 1;
    }
    return 0;
  }

  std::mt19937_64 rng(seed);
  long init_fail = 0, exec_fail = 0, ok = 0;
  for (long n = 0; n < fuzz; ++n) {
    std::vector<uint8_t> m = mutate(blob, rng);
    if (!quiet) std::fprintf(stderr, "fuzz case %ld\n", n);  // the last one names a crashing case
    Outcome o = run_once(backend, m, specs, 1, false);
    if (o.init != Error::Ok) {
      ++init_fail;
    } else if (o.exec != Error::Ok) {
      ++exec_fail;
    } else {
      ++ok;
    }
  }
  std::printf("FUZZ %ld cases: %ld rejected at init, %ld failed at execute, %ld ran\n", fuzz,
              init_fail, exec_fail, ok);
  return 0;
}
