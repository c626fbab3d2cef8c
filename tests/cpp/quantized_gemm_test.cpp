// The many-row quantized product (kernels/quantized_gemm.h) against a double-precision reference from
// the packed layout, over shapes that leave partial register tiles in both directions (rows not a
// multiple of 32 or 12, outputs not a multiple of 14 or 16), 4 and 8 bits, groups 32/64/128, every scale
// type; and each row equal bit for bit to the same row multiplied alone. Then the same for the integer
// activations, for each integer kernel the CPU runs (kernels/quantized_gemm_vnni.h on AVX-512 VNNI,
// kernels/quantized_gemm_avx2.h on AVX2; int16 and int8, the layouts each handles): within float32 rounding of
// a double reference of the same integer formula, and within the rounding bound of the activations (meeting
// the centred weights) of the exact product; with a control that the int8 results break the int16 bound (so
// the bound says something).
// Prints "float skipped" where the CPU lacks AVX-512 (the float32 tiles) and "<kernel> skipped" for an
// integer kernel it cannot run, then "N passed, N failed"; exit status 1 on any failure.
//
// `etmlx_quantized_gemm_test --bench M K N [RUNS [GROUP]]` times one 4-bit product (group 64 unless given) per mode instead
// (float32 where AVX-512 runs it, int16, int8 on the integer kernel the library picks; interleaved; medians).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/quantized_activations.h"
#include "kernels/quantized_gemm.h"
#include "kernels/quantized_gemm_avx2.h"
#include "kernels/quantized_gemm_vnni.h"

using namespace etmlx::kernels;

namespace {

int passed = 0, failed = 0;

uint16_t to_half_bits(float f, ScaleType t) {  // the test values (k / 256, |k| < 256) are exact in both
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (t == ScaleType::bf16) return static_cast<uint16_t>(u >> 16);
  if ((u & 0x7fffffff) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000);
  const int e = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
  return static_cast<uint16_t>(((u >> 16) & 0x8000) | (e << 10) | ((u >> 13) & 0x3ff));
}

// A random W in MLX's layout with its float32 scales and biases (exact in every scale type).
struct Weights {
  int n, k, bits, group;
  std::vector<uint8_t> bytes;
  std::vector<uint32_t> words;
  std::vector<float> s, b;
  std::vector<uint16_t> s16, b16;
  QuantizedMatrix w{};

  Weights(int n_, int k_, int bits_, int group_, ScaleType type, std::mt19937& rng)
      : n(n_), k(k_), bits(bits_), group(group_), bytes(static_cast<size_t>(n_) * k_ * bits_ / 8) {
    for (auto& e : bytes) e = static_cast<uint8_t>(rng());
    words.resize(bytes.size() / 4);
    std::memcpy(words.data(), bytes.data(), bytes.size());
    std::uniform_int_distribution<int> steps(-255, 255);
    s.resize(static_cast<size_t>(n) * (k / group));
    b.resize(s.size());
    for (size_t i = 0; i < s.size(); ++i) s[i] = steps(rng) / 256.0f, b[i] = steps(rng) / 256.0f;
    s16.resize(s.size());
    b16.resize(s.size());
    for (size_t i = 0; i < s.size(); ++i) s16[i] = to_half_bits(s[i], type), b16[i] = to_half_bits(b[i], type);
    const bool f32 = type == ScaleType::f32;
    w = QuantizedMatrix{words.data(), f32 ? static_cast<const void*>(s.data()) : s16.data(),
                        f32 ? static_cast<const void*>(b.data()) : b16.data(), type, n, k, bits, group};
  }
  int q(int row, int j) const {
    const uint8_t byte = bytes[static_cast<size_t>(row) * k * bits / 8 + j * bits / 8];
    return bits == 8 ? byte : (byte >> (4 * (j & 1))) & 0xf;
  }
  double scale(int row, int j) const { return s[static_cast<size_t>(row) * (k / group) + j / group]; }
  double bias(int row, int j) const { return b[static_cast<size_t>(row) * (k / group) + j / group]; }
};

std::vector<float> random_x(int m, int k, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(m) * k);
  for (auto& e : x) e = normal(rng);
  return x;
}

using Product = void (*)(const float* x, int m, const QuantizedMatrix& w, float* out, ActivationPrecision p);
void float_gemm(const float* x, int m, const QuantizedMatrix& w, float* out, ActivationPrecision) {
  quantized_gemm(x, m, w, ActivationPrecision::float32, out);
}
// An integer-activation kernel and the layouts it takes; `current` is the one the int checks call.
struct IntKernel {
  const char* name;
  bool (*handles)(int bits, int group);
  void (*run)(const float* x, int m, const QuantizedMatrix& w, ActivationPrecision p, float* out);
};
const IntKernel kIntKernels[] = {{"vnni", quantized_gemm_vnni_available, quantized_gemm_vnni},
                                 {"avx2", quantized_gemm_avx2_available, quantized_gemm_avx2}};
const IntKernel* current = nullptr;

void int_gemm(const float* x, int m, const QuantizedMatrix& w, float* out, ActivationPrecision p) {
  current->run(x, m, w, p, out);
}

// Every 7th row alone gives the bits it has within the batch.
bool rows_alone_equal(Product f, const std::vector<float>& x, int m, const Weights& wt, const std::vector<float>& out,
                      ActivationPrecision p) {
  bool same = true;
  for (int r = 0; r < m; r += 7) {
    std::vector<float> alone(wt.n);
    f(x.data() + static_cast<size_t>(r) * wt.k, 1, wt.w, alone.data(), p);
    same = same && std::memcmp(alone.data(), out.data() + static_cast<size_t>(r) * wt.n, sizeof(float) * wt.n) == 0;
  }
  return same;
}

void report(bool ok, const char* what, int m, const Weights& wt, ScaleType type, const char* detail) {
  (ok ? passed : failed)++;
  if (!ok) {
    std::printf("FAIL %s%s%s m=%d n=%d k=%d bits=%d group=%d type=%d: %s\n", current ? current->name : "",
                current ? " " : "", what, m, wt.n, wt.k, wt.bits, wt.group, static_cast<int>(type), detail);
  }
}

void check_float(int m, int n, int k, int bits, int group, ScaleType type, std::mt19937& rng) {
  const Weights wt(n, k, bits, group, type, rng);
  const std::vector<float> x = random_x(m, k, rng);
  std::vector<float> out(static_cast<size_t>(m) * n, NAN);
  quantized_gemm(x.data(), m, wt.w, ActivationPrecision::float32, out.data());
  double worst = 0.0;
  for (int r = 0; r < m; ++r) {
    for (int c = 0; c < n; ++c) {
      double ref = 0.0, mag = 0.0;
      for (int j = 0; j < k; ++j) {
        const double wv = wt.scale(c, j) * wt.q(c, j) + wt.bias(c, j);
        ref += wv * x[static_cast<size_t>(r) * k + j];
        mag += std::fabs(wv * x[static_cast<size_t>(r) * k + j]);
      }
      // float32 sums of k products: within k * 2^-24 of their magnitude (NaN, an unwritten output, fails).
      const double err = std::fabs(out[static_cast<size_t>(r) * n + c] - ref) / (mag * k * 6e-8 + 1e-30);
      worst = std::isnan(err) ? INFINITY : std::max(worst, err);
    }
  }
  const bool invariant = rows_alone_equal(float_gemm, x, m, wt, out, ActivationPrecision::float32);
  char detail[128];
  std::snprintf(detail, sizeof detail, "error %.3g of bound, rows alone %s", worst, invariant ? "equal" : "DIFFER");
  report(worst <= 1.0 && invariant, "float32", m, wt, type, detail);
}

// Per output, the worst ratio of |out - reference| to its bound, for the integer kernel's two bounds.
struct IntErrors {
  double same_formula = 0.0;  // vs the double value of the integer formula, bound: float32 rounding
  double exact = 0.0;         // vs the exact product, bound: the activations' rounding + float32 rounding
};

// out from the int kernel at precision p; bound_p the precision whose rounding bound is checked against
// the exact product (p itself, or int16 for the int8 control).
IntErrors int_errors(const std::vector<float>& x, int m, const Weights& wt, const std::vector<float>& out,
                     ActivationPrecision p, ActivationPrecision bound_p) {
  const int k = wt.k, n = wt.n, group = wt.group, groups = k / group;
  const int qmax = p == ActivationPrecision::int16 ? kInt16Max : kInt8Max;
  const int bound_qmax = bound_p == ActivationPrecision::int16 ? kInt16Max : kInt8Max;
  IntErrors e;
  std::vector<int> q(static_cast<size_t>(k));
  std::vector<float> step(groups), bound_step(groups);
  std::vector<double> xsum(groups), xabs(groups), res(groups), res_abs(groups);
  std::vector<int8_t> hi(group), lo(group);
  for (int r = 0; r < m; ++r) {
    const float* xr = x.data() + static_cast<size_t>(r) * k;
    for (int g = 0; g < groups; ++g) {
      step[g] = quantize_activation_group(xr + g * group, group, p, hi.data(), lo.data());
      float largest = 0.0f;
      xsum[g] = xabs[g] = res[g] = res_abs[g] = 0.0;
      for (int i = 0; i < group; ++i) {
        q[g * group + i] = p == ActivationPrecision::int16 ? 256 * hi[i] + lo[i] : hi[i];
        largest = std::max(largest, std::fabs(xr[g * group + i]));
        xsum[g] += xr[g * group + i];
        xabs[g] += std::fabs(xr[g * group + i]);
        const double left = double(xr[g * group + i]) - double(step[g]) * q[g * group + i];  // exact
        res[g] += left;
        res_abs[g] += std::fabs(left);
      }
      bound_step[g] = largest / static_cast<float>(bound_qmax);
    }
    for (int c = 0; c < n; ++c) {
      double formula = 0.0, exact = 0.0, mag = 0.0, rounding = 0.0;
      const double centre = 1 << (wt.bits - 1);
      for (int g = 0; g < groups; ++g) {
        int64_t isum = 0;
        double dot = 0.0, centred = 0.0;
        for (int i = g * group; i < (g + 1) * group; ++i) {
          isum += int64_t{wt.q(c, i)} * q[i];
          centred += std::fabs(wt.q(c, i) - centre);
          dot += double(wt.q(c, i)) * xr[i];
        }
        const double s = wt.scale(c, g * group), b = wt.bias(c, g * group);
        // quantized_gemm_vnni.h: scale * step * (q_w . q) + bias * sum(x) + centre * scale * residual.
        formula += s * step[g] * double(isum) + b * xsum[g] + centre * s * res[g];
        exact += s * dot + b * xsum[g];
        // Float32: per group int-to-float, two multiplies and three accumulating multiply-adds, the sums of x
        // and of the residuals in float32 (group additions): within (3 groups + group + 4) * 2^-24 of these
        // magnitudes.
        mag += std::fabs(s * step[g] * double(isum)) + std::fabs(b) * xabs[g] + centre * std::fabs(s) * res_abs[g];
        // The rounding meets the centred weights: |x - step * q| <= step / 2, plus step and qmax / max|x|
        // each rounded to float32 once.
        rounding += std::fabs(s) * bound_step[g] * (0.5 + bound_qmax * 2.4e-7) * centred;
      }
      const double tol = mag * (3.0 * groups + group + 4) * 6e-8 + 1e-30;
      const double got = out[static_cast<size_t>(r) * n + c];
      const double e1 = std::fabs(got - formula) / tol, e2 = std::fabs(got - exact) / (rounding + tol);
      e.same_formula = std::isnan(e1) ? INFINITY : std::max(e.same_formula, e1);
      e.exact = std::isnan(e2) ? INFINITY : std::max(e.exact, e2);
    }
  }
  (void)qmax;
  return e;
}

// Returns the worst ratio of the int8 results to the int16 bound (the control).
double check_int(int m, int n, int k, int bits, int group, ScaleType type, std::mt19937& rng) {
  const Weights wt(n, k, bits, group, type, rng);
  const std::vector<float> x = random_x(m, k, rng);
  double control = 0.0;
  for (ActivationPrecision p : {ActivationPrecision::int16, ActivationPrecision::int8}) {
    std::vector<float> out(static_cast<size_t>(m) * n, NAN);
    current->run(x.data(), m, wt.w, p, out.data());
    const IntErrors e = int_errors(x, m, wt, out, p, p);
    const bool invariant = rows_alone_equal(int_gemm, x, m, wt, out, p);
    char detail[160];
    std::snprintf(detail, sizeof detail, "error %.3g of the same-formula bound, %.3g of the exact one, rows alone %s",
                  e.same_formula, e.exact, invariant ? "equal" : "DIFFER");
    report(e.same_formula <= 1.0 && e.exact <= 1.0 && invariant, activation_precision_name(p), m, wt, type, detail);
    if (p == ActivationPrecision::int8) control = int_errors(x, m, wt, out, p, ActivationPrecision::int16).exact;
  }
  return control;
}

// The activations' integers themselves, bit for bit those of quantize_activation_group (a one-unit
// difference in an int16 value is below the float32 bounds above): with W the identity (weight 1 on the
// diagonal, scale 1, bias 0) output j is step * q_j + centre * (the row's residuals, every group's), within
// a float32 rounding of those few hundred steps: far less than the step a wrong integer would add.
void check_int_identity(int bits, int group, ActivationPrecision p, std::mt19937& rng) {
  const int k = 256, m = 13;
  Weights wt(k, k, bits, group, ScaleType::f32, rng);
  std::fill(wt.bytes.begin(), wt.bytes.end(), 0);
  for (int j = 0; j < k; ++j) wt.bytes[static_cast<size_t>(j) * k * bits / 8 + j * bits / 8] = bits == 8 ? 1 : 1 << (4 * (j & 1));
  std::memcpy(wt.words.data(), wt.bytes.data(), wt.bytes.size());
  std::fill(wt.s.begin(), wt.s.end(), 1.0f);
  std::fill(wt.b.begin(), wt.b.end(), 0.0f);
  const std::vector<float> x = random_x(m, k, rng);
  std::vector<float> out(static_cast<size_t>(m) * k);
  current->run(x.data(), m, wt.w, p, out.data());
  std::vector<int8_t> hi(group), lo(group);
  std::vector<int> q(k);
  std::vector<float> step(k / group);
  int wrong = 0;
  for (int r = 0; r < m; ++r) {
    double residuals = 0.0;  // every group's: the other groups' weights are 0, centred -centre
    for (int g = 0; g < k / group; ++g) {
      const float* xg = x.data() + static_cast<size_t>(r) * k + g * group;
      step[g] = quantize_activation_group(xg, group, p, hi.data(), lo.data());
      for (int i = 0; i < group; ++i) {
        q[g * group + i] = p == ActivationPrecision::int16 ? 256 * hi[i] + lo[i] : hi[i];
        residuals += double(xg[i]) - double(step[g]) * q[g * group + i];
      }
    }
    for (int j = 0; j < k; ++j) {
      const double expected = double(step[j / group]) * q[j] + (1 << (bits - 1)) * residuals;
      wrong += std::fabs(out[static_cast<size_t>(r) * k + j] - expected) > 0.25 * step[j / group];
    }
  }
  char detail[64];
  std::snprintf(detail, sizeof detail, "%s: %d of %d integers differ", activation_precision_name(p), wrong, m * k);
  report(wrong == 0, "identity", m, wt, ScaleType::f32, detail);
}

// The largest integer sums: weights all at their largest (8 bits: 255; 4 bits: 15, the AVX2 kernel's widest),
// group 128, every activation of a group at its group's largest magnitude (q = +-32512 for int16: at 8 bits
// 256 * 255 * 127 * 128 per group, near 2^30; at 4 bits eight 16-bit pair sums of 2 * 15 * 127 each before
// they are widened), signs alternating by group; within the same bounds as random values (an int32 overflow
// would be off by 2^32, a 16-bit one by 2^16).
void check_int_extreme(int bits, std::mt19937& rng) {
  const int m = 13, n = 20, k = 512;
  Weights wt(n, k, bits, 128, ScaleType::f32, rng);
  std::fill(wt.bytes.begin(), wt.bytes.end(), 0xff);
  std::memcpy(wt.words.data(), wt.bytes.data(), wt.bytes.size());
  std::vector<float> x(static_cast<size_t>(m) * k);
  for (size_t i = 0; i < x.size(); ++i) x[i] = ((i % k) / 128 % 2 ? -1.0f : 1.0f) * (1.0f + static_cast<float>(i / k));
  for (ActivationPrecision p : {ActivationPrecision::int16, ActivationPrecision::int8}) {
    std::vector<float> out(static_cast<size_t>(m) * n, NAN);
    current->run(x.data(), m, wt.w, p, out.data());
    const IntErrors e = int_errors(x, m, wt, out, p, p);
    char detail[128];
    std::snprintf(detail, sizeof detail, "%s: error %.3g of the same-formula bound, %.3g of the exact one",
                  activation_precision_name(p), e.same_formula, e.exact);
    report(e.same_formula <= 1.0 && e.exact <= 1.0, "extreme", m, wt, ScaleType::f32, detail);
  }
}

// Non-finite activations: the group's step is NaN, so every output of that row is NaN, as in float32;
// the other rows are untouched.
void check_int_non_finite(std::mt19937& rng) {
  const Weights wt(40, 256, 4, 64, ScaleType::bf16, rng);
  std::vector<float> x = random_x(20, 256, rng);
  x[3 * 256 + 70] = INFINITY;
  std::vector<float> out(20 * 40), alone(40);
  current->run(x.data(), 20, wt.w, ActivationPrecision::int8, out.data());
  current->run(x.data() + 4 * 256, 1, wt.w, ActivationPrecision::int8, alone.data());
  bool ok = std::memcmp(alone.data(), out.data() + 4 * 40, sizeof(float) * 40) == 0;
  for (int c = 0; c < 40; ++c) ok = ok && std::isnan(out[3 * 40 + c]) && std::isfinite(out[4 * 40 + c]);
  report(ok, "non-finite", 20, wt, ScaleType::bf16, "a row with inf is not all NaN, or other rows changed");
}

// A panel of m < 12 rows runs a kernel made for m rows (a verify call of 9 rows does not pay for 12), and a
// product of one panel (m <= 12) unpacks each W tile just before multiplying it (VNNI; AVX2: tiles of 1 to 4
// rows): every m from 1 to 12 gives the bits its rows have within 13 rows (two panels: the block path), at
// both precisions and bits, over a few tiles of W (the last one partial).
void check_int_row_counts(std::mt19937& rng) {
  for (int bits : {4, 8}) {
    if (!current->handles(bits, 64)) continue;
    const Weights wt(37, 384, bits, 64, ScaleType::bf16, rng);
    const std::vector<float> x = random_x(13, 384, rng);
    for (ActivationPrecision p : {ActivationPrecision::int16, ActivationPrecision::int8}) {
      std::vector<float> all(13 * 37);
      current->run(x.data(), 13, wt.w, p, all.data());
      int differ = 0;
      for (int m = 1; m <= 12; ++m) {
        std::vector<float> out(static_cast<size_t>(m) * 37);
        current->run(x.data(), m, wt.w, p, out.data());
        differ += std::memcmp(out.data(), all.data(), sizeof(float) * out.size()) != 0;
      }
      char detail[96];
      std::snprintf(detail, sizeof detail, "%s: %d of 12 row counts differ from their rows among 13",
                    activation_precision_name(p), differ);
      report(differ == 0, "row counts", 13, wt, ScaleType::bf16, detail);
    }
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int bench(int m, int k, int n, int runs, int group) {
  std::mt19937 rng(3);
  const Weights wt(n, k, 4, group, ScaleType::bf16, rng);
  const std::vector<float> x = random_x(m, k, rng);
  std::vector<float> out(static_cast<size_t>(m) * n);
  const bool float_tiles = quantized_gemm_available();
  for (const IntKernel& kernel : kIntKernels) {
    if (current == nullptr && kernel.handles(4, group)) current = &kernel;
  }
  const ActivationPrecision modes[] = {ActivationPrecision::float32, ActivationPrecision::int16,
                                       ActivationPrecision::int8};
  std::vector<double> ms[3];
  for (int run = -1; run < runs; ++run) {  // run -1 warms up (buffers, pool threads)
    for (int i = float_tiles ? 0 : 1; i < (current ? 3 : 1); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      if (i == 0) quantized_gemm(x.data(), m, wt.w, ActivationPrecision::float32, out.data());
      else current->run(x.data(), m, wt.w, modes[i], out.data());
      const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (run >= 0) ms[i].push_back(t);
    }
  }
  for (int i = 0; i < 3; ++i) {
    if (ms[i].empty()) continue;
    const double med = median(ms[i]);
    std::printf("%d x %d x %d 4-bit g%d %-7s %-5s median %.2f ms (%d runs) %.0f GFLOP/s\n", m, k, n, group,
                activation_precision_name(modes[i]), i == 0 ? "tiles" : current->name, med, runs,
                2.0 * m * k * n / med / 1e6);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The float32 checks (and --bench's float32 column) call quantized_gemm() at float32 activations; the integer
  // kernels are called directly.
  if (argc >= 5 && std::strcmp(argv[1], "--bench") == 0) {
    return bench(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), argc >= 6 ? std::atoi(argv[5]) : 9,
                 argc >= 7 ? std::atoi(argv[6]) : 64);
  }
  std::mt19937 rng(11);
  if (!quantized_gemm_available()) {
    std::printf("float skipped: no AVX-512 (or ETMLX_QMM_ISA set)\n");
  } else {
    for (int bits : {4, 8})
      for (int group : {32, 64, 128})
        for (ScaleType t : {ScaleType::f32, ScaleType::f16, ScaleType::bf16})
          for (auto [m, n] : {std::pair{16, 14}, std::pair{33, 29}, std::pair{70, 129}})
            check_float(m, n, 384, bits, group, t, rng);
    check_float(64, 300, 1024, 4, 64, ScaleType::bf16, rng);  // several W tiles per thread block
  }
  int kernels_run = 0;
  for (const IntKernel& kernel : kIntKernels) {
    if (!kernel.handles(4, 64)) {
      std::printf("%s skipped: this CPU cannot run it\n", kernel.name);
      continue;
    }
    current = &kernel;
    ++kernels_run;
    double control = INFINITY;
    for (int bits : {4, 8})
      for (int group : {32, 64, 128}) {
        if (!kernel.handles(bits, group)) continue;
        for (ScaleType t : {ScaleType::f32, ScaleType::f16, ScaleType::bf16})
          for (auto [m, n] : {std::pair{16, 14}, std::pair{25, 33}, std::pair{70, 129}})
            control = std::min(control, check_int(m, n, 384, bits, group, t, rng));
      }
    check_int(64, 300, 1024, 4, 64, ScaleType::bf16, rng);
    check_int(13, 70, 2048, kernel.handles(8, 128) ? 8 : 4, 128, ScaleType::f32, rng);  // large integer sums
    check_int_non_finite(rng);
    check_int_extreme(kernel.handles(8, 128) ? 8 : 4, rng);
    check_int_row_counts(rng);
    for (int bits : {4, 8})
      for (int group : {32, 64, 128})
        for (ActivationPrecision p : {ActivationPrecision::int16, ActivationPrecision::int8})
          if (kernel.handles(bits, group)) check_int_identity(bits, group, p, rng);
    // The control: every case's int8 results break the int16 bound, by far.
    const bool breaks = control > 4.0;
    (breaks ? passed : failed)++;
    std::printf("%s %s: int8 results reach at least %.3g x the int16 rounding bound in every case\n", kernel.name,
                breaks ? "control ok" : "FAIL control", control);
  }
  std::printf("%d passed, %d failed (%d integer kernels)\n", passed, failed, kernels_run);
  return failed ? 1 : 0;
}
