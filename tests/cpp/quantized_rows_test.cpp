// Every quantized_rows.h variant this CPU can run, against a double-precision reference computed
// from the packed layout directly (value j of a row: bits [bits*j, bits*j + bits) of its bytes), and
// a row's result computed alone equal bit for bit to the same row within a batch.
// Variants with integer rows (AVX-512 VNNI; AVX2 at 4 bits) are also checked at int16 and int8 (check_integer).
// Prints one line per failure and ends with "N passed, N failed"; exit status 1 on any failure.
// Built standalone (no MLX), so it also runs where the library is not built, e.g. on another CPU:
//   g++ -std=c++20 -O2 -I backends/mlx/runtime tests/cpp/quantized_rows_test.cpp
//       backends/mlx/runtime/kernels/quantized_rows*.cpp backends/mlx/runtime/kernels/quantized_activations.cpp
//       -o quantized_rows_test
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/quantized_rows.h"
#include "kernels/quantized_rows_variants.h"

using namespace etmlx::kernels;

namespace {

int passed = 0, failed = 0;

struct Case {
  int m, n, k, bits, group;
  ScaleType type;
};

uint16_t to_half_bits(float f, ScaleType t) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (t == ScaleType::bf16) return static_cast<uint16_t>(u >> 16);  // test values are exact in bf16
  // f16: the test values (k / 256, |k| < 256) are exact, normal f16 numbers.
  const int e = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
  if ((u & 0x7fffffff) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000);
  return static_cast<uint16_t>(((u >> 16) & 0x8000) | (e << 10) | ((u >> 13) & 0x3ff));
}

// A random case: packed W with scales and biases exact in every scale type, and x [m, k] from a normal.
struct Problem {
  int groups;
  std::vector<uint8_t> bytes;
  std::vector<uint32_t> words;
  std::vector<float> s, b, x;
  std::vector<uint16_t> s16, b16;
  QuantizedMatrix w;

  Problem(const Case& c, std::mt19937& rng) : groups(c.k / c.group) {
    bytes.resize(static_cast<size_t>(c.n) * c.k * c.bits / 8);
    for (auto& e : bytes) e = static_cast<uint8_t>(rng());
    words.resize(bytes.size() / 4);
    std::memcpy(words.data(), bytes.data(), bytes.size());
    std::uniform_int_distribution<int> steps(-255, 255);  // k / 256: exact in bf16 and f16
    s.resize(static_cast<size_t>(c.n) * groups), b.resize(s.size());
    for (size_t i = 0; i < s.size(); ++i) s[i] = steps(rng) / 256.0f, b[i] = steps(rng) / 256.0f;
    s16.resize(s.size()), b16.resize(s.size());
    for (size_t i = 0; i < s.size(); ++i) s16[i] = to_half_bits(s[i], c.type), b16[i] = to_half_bits(b[i], c.type);
    const bool f32 = c.type == ScaleType::f32;
    w = QuantizedMatrix{words.data(), f32 ? static_cast<const void*>(s.data()) : s16.data(),
                        f32 ? static_cast<const void*>(b.data()) : b16.data(), c.type, c.n, c.k, c.bits, c.group};
    std::normal_distribution<float> normal;
    x.resize(static_cast<size_t>(c.m) * c.k);
    for (auto& e : x) e = normal(rng);
  }
  // Value j of W's row n.
  int q_at(const Case& c, int n, int j) const {
    const uint8_t byte = bytes[static_cast<size_t>(n) * c.k * c.bits / 8 + j * c.bits / 8];
    return c.bits == 8 ? byte : (byte >> (4 * (j & 1))) & 0xf;
  }
};

void check(const RowsVariant& v, const Case& c, std::mt19937& rng) {
  Problem pb(c, rng);
  const int groups = pb.groups;
  const std::vector<float>&s = pb.s, &b = pb.b, &x = pb.x;
  const QuantizedMatrix& w = pb.w;
  auto q_at = [&](int n, int j) { return pb.q_at(c, n, j); };
  std::vector<float> xp(x.size()), sums(static_cast<size_t>(c.m) * groups), out(static_cast<size_t>(c.m) * c.n);
  prepare_activations(x.data(), c.m, c.k, c.bits, c.group, xp.data(), sums.data());
  for (int r0 = 0; r0 < c.m; r0 += kMaxRows) {
    const int rows = std::min(kMaxRows, c.m - r0);
    const PreparedRows pr{xp.data() + static_cast<size_t>(r0) * c.k, sums.data() + static_cast<size_t>(r0) * groups,
                          rows};
    // Two ranges of output rows, as the thread pool splits them.
    v.dot(w, pr, 0, c.n / 2, out.data() + static_cast<size_t>(r0) * c.n, c.n);
    v.dot(w, pr, c.n / 2, c.n, out.data() + static_cast<size_t>(r0) * c.n + c.n / 2, c.n);
  }
  // Each row alone (one-row calls) gives the same bits as within the batch.
  bool invariant = true;
  for (int r = 0; r < c.m; ++r) {
    std::vector<float> alone(c.n);
    const PreparedRows one{xp.data() + static_cast<size_t>(r) * c.k, sums.data() + static_cast<size_t>(r) * groups, 1};
    v.dot(w, one, 0, c.n, alone.data(), c.n);
    invariant = invariant && std::memcmp(alone.data(), out.data() + static_cast<size_t>(r) * c.n, sizeof(float) * c.n) == 0;
  }
  double worst = 0.0;
  for (int r = 0; r < c.m; ++r) {
    for (int n = 0; n < c.n; ++n) {
      double ref = 0.0, mag = 0.0;
      for (int j = 0; j < c.k; ++j) {
        const double wv = double(s[n * groups + j / c.group]) * q_at(n, j) + b[n * groups + j / c.group];
        ref += wv * x[static_cast<size_t>(r) * c.k + j];
        mag += std::fabs(wv * x[static_cast<size_t>(r) * c.k + j]);
      }
      // float32 sums of k terms: error well under k * 2^-24 of the terms' magnitude.
      const double err = std::fabs(out[static_cast<size_t>(r) * c.n + n] - ref) / (mag * c.k * 6e-8 + 1e-30);
      worst = std::max(worst, err);
    }
  }
  std::vector<float> deq(static_cast<size_t>(c.n) * c.k);
  v.dequantize(w, 0, c.n, deq.data());
  double deq_err = 0.0;
  for (int n = 0; n < c.n; ++n) {
    for (int j = 0; j < c.k; ++j) {
      const double ref = double(s[n * groups + j / c.group]) * q_at(n, j) + b[n * groups + j / c.group];
      deq_err = std::max(deq_err, std::fabs(deq[static_cast<size_t>(n) * c.k + j] - ref) / (std::fabs(ref) + 1e-3));
    }
  }
  const bool ok = worst <= 1.0 && deq_err <= 1e-6 && invariant;
  (ok ? passed : failed)++;
  if (!ok) {
    std::printf("FAIL %s m=%d n=%d k=%d bits=%d group=%d type=%d: dot error %.3g of bound, dequantize %.3g, "
                "rows alone %s\n", v.name, c.m, c.n, c.k, c.bits, c.group, static_cast<int>(c.type), worst, deq_err,
                invariant ? "equal" : "DIFFER");
  }
}

// The integer (VNNI) loop of a variant that has one: against a double reference of the same integer
// formula (PreparedRows::residuals), within float32 rounding; against the exact float product, within the
// precision's stated bound sum_g |s_g| * step_g / 2 * sum_i |q_i - 2^(bits-1)|; rows alone = rows in a batch.
// Returns whether the result was within int16's bound too (for the control in main).
bool check_integer(const RowsVariant& v, const Case& c, ActivationPrecision p, std::mt19937& rng) {
  Problem pb(c, rng);
  pb.x[3] = 40.0f;  // an outlier: its group's step is coarse, the others' are not
  const int groups = pb.groups;
  const std::vector<float>&s = pb.s, &b = pb.b, &x = pb.x;
  const QuantizedMatrix& w = pb.w;
  auto q_at = [&](int n, int j) { return pb.q_at(c, n, j); };
  const bool int16 = p == ActivationPrecision::int16;
  std::vector<int8_t> hi(x.size()), lo(int16 ? x.size() : 0);
  std::vector<float> steps(static_cast<size_t>(c.m) * groups), residuals(steps.size()), sums(steps.size()),
      out(static_cast<size_t>(c.m) * c.n);
  prepare_integer_activations(x.data(), c.m, c.k, c.bits, c.group, p, hi.data(), int16 ? lo.data() : nullptr,
                              steps.data(), residuals.data(), sums.data());
  auto rows_at = [&](int r0, int count) {
    PreparedRows pr{nullptr, sums.data() + static_cast<size_t>(r0) * groups, count};
    pr.hi = hi.data() + static_cast<size_t>(r0) * c.k;
    pr.lo = int16 ? lo.data() + static_cast<size_t>(r0) * c.k : nullptr;
    pr.steps = steps.data() + static_cast<size_t>(r0) * groups;
    pr.residuals = residuals.data() + static_cast<size_t>(r0) * groups;
    return pr;
  };
  for (int r0 = 0; r0 < c.m; r0 += kMaxRows) {
    const PreparedRows pr = rows_at(r0, std::min(kMaxRows, c.m - r0));
    v.dot(w, pr, 0, c.n / 2, out.data() + static_cast<size_t>(r0) * c.n, c.n);
    v.dot(w, pr, c.n / 2, c.n, out.data() + static_cast<size_t>(r0) * c.n + c.n / 2, c.n);
  }
  bool invariant = true;
  for (int r = 0; r < c.m; ++r) {
    std::vector<float> alone(c.n);
    v.dot(w, rows_at(r, 1), 0, c.n, alone.data(), c.n);
    invariant = invariant && std::memcmp(alone.data(), out.data() + static_cast<size_t>(r) * c.n, sizeof(float) * c.n) == 0;
  }
  // The integers in natural order again: the prepared order is per 64-value block (see quantized_rows.h).
  auto qx = [&](int r, int j) {
    const int block = j / kIntBlock * kIntBlock, i = j % kIntBlock;
    const int at = c.bits == 4 ? (i % 2 == 0 ? i / 2 : kIntBlock / 2 + i / 2) : i;
    const size_t idx = static_cast<size_t>(r) * c.k + block + at;
    return int16 ? 256 * hi[idx] + lo[idx] : hi[idx];
  };
  // The variant's integers and steps are quantize_activation_group's (its definition), bit for bit.
  bool same_rounding = true;
  std::vector<int8_t> qh(c.group), ql(c.group);
  for (int r = 0; r < c.m; ++r) {
    for (int g = 0; g < groups; ++g) {
      const float step = quantize_activation_group(x.data() + static_cast<size_t>(r) * c.k + g * c.group, c.group, p,
                                                   qh.data(), int16 ? ql.data() : nullptr);
      same_rounding = same_rounding && std::memcmp(&step, &steps[r * groups + g], sizeof step) == 0;
      for (int i = 0; i < c.group; ++i) {
        same_rounding = same_rounding && qx(r, g * c.group + i) == (int16 ? 256 * qh[i] + ql[i] : qh[i]);
      }
    }
  }
  double worst_formula = 0.0, worst_bound = 0.0, worst_int16 = 0.0;
  for (int r = 0; r < c.m; ++r) {
    for (int n = 0; n < c.n; ++n) {
      double formula = 0.0, mag = 0.0, exact = 0.0, slack = 0.0, slack16 = 0.0;
      const double centre = 1 << (c.bits - 1);
      for (int g = 0; g < groups; ++g) {
        const double sg = s[n * groups + g], bg = b[n * groups + g], step = steps[r * groups + g];
        double integer = 0.0, qsum = 0.0, largest = 0.0;
        for (int j = g * c.group; j < (g + 1) * c.group; ++j) {
          integer += double(q_at(n, j)) * qx(r, j);
          qsum += std::fabs(q_at(n, j) - centre);
          const double xv = x[static_cast<size_t>(r) * c.k + j];
          exact += (sg * q_at(n, j) + bg) * xv;
          largest = std::max(largest, std::fabs(xv));
        }
        const double rg = residuals[r * groups + g];
        formula += sg * step * integer + bg * sums[r * groups + g] + centre * sg * rg;
        mag += std::fabs(sg * step * integer) + std::fabs(bg * sums[r * groups + g]) + std::fabs(centre * sg * rg);
        slack += std::fabs(sg) * step / 2 * qsum * 1.001;
        slack16 += std::fabs(sg) * largest / 32512.0 / 2 * qsum * 1.001;
      }
      const double got = out[static_cast<size_t>(r) * c.n + n];
      // float32: one rounding per group's scale * step, multiply-add and bias fma, 16 lanes summed.
      const double rounding = mag * (groups + 16) * 1.2e-7 + 1e-30;
      worst_formula = std::max(worst_formula, std::fabs(got - formula) / rounding);
      worst_bound = std::max(worst_bound, std::fabs(got - exact) / (slack + 2 * rounding + c.k * 1.2e-7 * mag));
      worst_int16 = std::max(worst_int16, std::fabs(got - exact) / (slack16 + 2 * rounding + c.k * 1.2e-7 * mag));
    }
  }
  const bool ok = worst_formula <= 1.0 && worst_bound <= 1.0 && invariant && same_rounding;
  (ok ? passed : failed)++;
  if (!ok) {
    std::printf("FAIL %s %s m=%d n=%d k=%d bits=%d group=%d type=%d: formula error %.3g, stated bound %.3g, "
                "rows alone %s, rounding %s\n", v.name, activation_precision_name(p), c.m, c.n, c.k, c.bits, c.group,
                static_cast<int>(c.type), worst_formula, worst_bound, invariant ? "equal" : "DIFFER",
                same_rounding ? "quantize_activation_group's" : "DIFFERS from quantize_activation_group");
  }
  return worst_int16 <= 1.0;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  std::vector<const RowsVariant*> variants{&scalar_rows()};
  for (const RowsVariant* v : {avx2_rows(), avx512_rows(), neon_rows()}) {
    if (v) variants.push_back(v);
  }
  for (const RowsVariant* v : variants) {
    std::printf("variant %s\n", v->name);
    for (int bits : {4, 8})
      for (int group : {32, 64, 128})
        for (ScaleType t : {ScaleType::f32, ScaleType::f16, ScaleType::bf16})
          for (int m : {1, 2, 3, 4, 7})
            check(*v, Case{m, 37, 384, bits, group, t}, rng);
    if (!v->integer_rows) continue;
    // Control: int8's results must break int16's bound somewhere, or that bound would say nothing.
    bool int8_within_int16 = true;
    for (ActivationPrecision p : {ActivationPrecision::int16, ActivationPrecision::int8})
      for (int bits : {4, 8})
        for (int group : {64, 128})
          for (ScaleType t : {ScaleType::f32, ScaleType::bf16})
            for (int m : {1, 2, 4, 5})
              for (int k : {384, 1152}) {  // 1152: more groups than one pass of the AVX2 loop's 8, and a remainder
                if (bits > v->integer_max_bits) continue;  // AVX2: 4-bit weights only
                const bool within = check_integer(*v, Case{m, 37, k, bits, group, t}, p, rng);
                if (p == ActivationPrecision::int8) int8_within_int16 = int8_within_int16 && within;
              }
    std::printf("variant %s integer rows: int8 %s int16's bound\n", v->name,
                int8_within_int16 ? "stays within (control FAILED)" : "breaks");
    (int8_within_int16 ? failed : passed)++;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
