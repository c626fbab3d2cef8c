// The C++ side's environment settings: every ETMLX_* variable the runtime library, the BLAS route and the
// C++ tools read is parsed here and nowhere else (tests/test_options.py checks the source), and
// docs/options.md is their table. Python's own settings are backends/mlx/runtime/options.py.
//
// Two kinds:
// - process options, read once at first use (a thread pool, a device, a BLAS cannot change under a
//   running program);
// - load options, read each time a program loads and kept by that program (debug and test switches:
//   a test loads the same program with and without one in a single process).
// A value that is not one the table allows is a one-line message on stderr naming the variable, and its
// default is used, except ETMLX_KERNELS and ETMLX_DEVICE, whose bad values refuse the load
// (ProcessOptions::device_error, LoadOptions::error): running on another device or kernel set than the one asked for
// would measure or test the wrong thing.
//
// Header only, so that every library and test program that compiles a reader of a setting (the backend,
// the BLAS route, the kernel test harnesses, the tools) gets the same parsing without another source file.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace etmlx::options {

enum class Device : uint8_t { mlx_default, cpu, gpu };
enum class Kernels : uint8_t { by_device, cpu, device };
// A load switch whose unset state keeps the per-program default.
enum class Forced : uint8_t { unset, off, on };

struct ProcessOptions {
  int num_threads = 0;  // ETMLX_NUM_THREADS: 1..1024; 0: the CPUs this process may run on
  Device device = Device::mlx_default;  // ETMLX_DEVICE
  bool blas_reference = false;  // ETMLX_BLAS=reference: the batch-invariant mode (docs/cpu-kernels.md)
  uint64_t max_array_bytes = 0;  // ETMLX_MAX_ARRAY_BYTES; 0: physical memory / RLIMIT_AS (size_limits.h)
  std::string qmm_isa;  // ETMLX_QMM_ISA: scalar|avx2|avx512|neon; empty: the best this CPU has
  std::string dot_file;  // ETMLX_DOT: each call's MLX graph as Graphviz; empty: none
  std::string text_tokenizer_plugin;  // ETMLX_TEXT_TOKENIZER_PLUGIN (etmlx_decode); empty: next to the program
  std::string device_error;  // a bad ETMLX_DEVICE: every load refuses with this line
};

struct LoadOptions {
  Kernels kernels = Kernels::by_device;  // ETMLX_KERNELS=cpu|device
  Forced host_fold = Forced::unset;  // ETMLX_HOST_FOLD=0|1 (host_fold.h; unset: by device)
  Forced fast_rope = Forced::unset;  // ETMLX_FAST_ROPE=0|1 (kernels/rope.h; unset: by kernel set)
  bool cpu_widen = true;  // ETMLX_CPU_WIDEN=0|1 (cpu_weights.h)
  bool report_widened = false;  // ETMLX_CPU_WIDEN=1: also say how many weights were widened
  bool fuse_linears = true;  // ETMLX_FUSE_LINEARS=0|1 (linear_groups.h)
  bool check_lazy = false;  // ETMLX_CHECK_LAZY=0|1 (lazy_check.h)
  std::string error;  // a bad ETMLX_KERNELS: the load refuses with this line
};

namespace detail {

inline const char* value_of(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

inline void warn(const char* name, const char* value, const char* expected) {
  std::fprintf(stderr, "etmlx: %s=%s is not %s; using the default\n", name, value, expected);
}

// 0 -> off, 1 -> on, unset -> unset; anything else is reported and left unset.
inline Forced switch_of(const char* name) {
  const char* v = value_of(name);
  if (v == nullptr) return Forced::unset;
  if (std::strcmp(v, "0") == 0) return Forced::off;
  if (std::strcmp(v, "1") == 0) return Forced::on;
  warn(name, v, "0 or 1");
  return Forced::unset;
}

inline ProcessOptions read_process() {
  ProcessOptions o;
  if (const char* v = value_of("ETMLX_NUM_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (end != v && *end == '\0' && n >= 1 && n <= 1024) {
      o.num_threads = static_cast<int>(n);
    } else {
      std::fprintf(stderr, "etmlx: ETMLX_NUM_THREADS=%s is not a thread count from 1 to 1024; using the CPUs "
                           "this process may run on\n", v);
    }
  }
  if (const char* v = value_of("ETMLX_DEVICE")) {
    if (std::strcmp(v, "cpu") == 0) o.device = Device::cpu;
    else if (std::strcmp(v, "gpu") == 0) o.device = Device::gpu;
    else o.device_error = std::string("ETMLX_DEVICE=") + v + " is not \"cpu\" or \"gpu\"";
  }
  if (const char* v = value_of("ETMLX_BLAS")) {
    if (std::strcmp(v, "reference") == 0) o.blas_reference = true;
    else warn("ETMLX_BLAS", v, "\"reference\"");
  }
  if (const char* v = value_of("ETMLX_MAX_ARRAY_BYTES")) {
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v, &end, 10);
    if (v[0] != '-' && end != v && *end == '\0' && n > 0) o.max_array_bytes = n;
    else warn("ETMLX_MAX_ARRAY_BYTES", v, "a positive number of bytes");
  }
  if (const char* v = value_of("ETMLX_QMM_ISA")) {
    // Whether this CPU has the named variant is kernels/quantized_rows.cpp's to say.
    if (std::strcmp(v, "scalar") == 0 || std::strcmp(v, "avx2") == 0 || std::strcmp(v, "avx512") == 0 ||
        std::strcmp(v, "neon") == 0) {
      o.qmm_isa = v;
    } else {
      warn("ETMLX_QMM_ISA", v, "scalar, avx2, avx512 or neon");
    }
  }
  if (const char* v = value_of("ETMLX_DOT")) o.dot_file = v;
  if (const char* v = value_of("ETMLX_TEXT_TOKENIZER_PLUGIN")) o.text_tokenizer_plugin = v;
  return o;
}

}  // namespace detail

// Read at the first call, in whichever library or program calls it (each keeps its own copy of the same values).
inline const ProcessOptions& process() {
  static const ProcessOptions o = detail::read_process();
  return o;
}

// Read now: the loader calls it once per program and keeps the result with the program.
inline LoadOptions read_load() {
  LoadOptions o;
  if (const char* v = detail::value_of("ETMLX_KERNELS")) {
    if (std::strcmp(v, "cpu") == 0) o.kernels = Kernels::cpu;
    else if (std::strcmp(v, "device") == 0) o.kernels = Kernels::device;
    else o.error = std::string("ETMLX_KERNELS=") + v + " is not \"cpu\" or \"device\"";
  }
  o.host_fold = detail::switch_of("ETMLX_HOST_FOLD");
  o.fast_rope = detail::switch_of("ETMLX_FAST_ROPE");
  const Forced widen = detail::switch_of("ETMLX_CPU_WIDEN");
  o.cpu_widen = widen != Forced::off;
  o.report_widened = widen == Forced::on;
  o.fuse_linears = detail::switch_of("ETMLX_FUSE_LINEARS") != Forced::off;
  o.check_lazy = detail::switch_of("ETMLX_CHECK_LAZY") == Forced::on;
  return o;
}

}  // namespace etmlx::options
