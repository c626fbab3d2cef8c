// Every quantized_rows.h variant this CPU can run, against a double-precision reference computed
// from the packed layout directly (value j of a row: bits [bits*j, bits*j + bits) of its bytes), and
// a row's result computed alone equal bit for bit to the same row within a batch.
// Prints one line per failure and ends with "N passed, N failed"; exit status 1 on any failure.
// Built standalone (no MLX), so it also runs where the library is not built, e.g. on another CPU:
//   g++ -std=c++20 -O2 -I backends/mlx/runtime tests/cpp/quantized_rows_test.cpp
//       backends/mlx/runtime/kernels/quantized_rows*.cpp -o quantized_rows_test
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

void check(const RowsVariant& v, const Case& c, std::mt19937& rng) {
  const int groups = c.k / c.group;
  std::vector<uint8_t> bytes(static_cast<size_t>(c.n) * c.k * c.bits / 8);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  std::vector<uint32_t> words(bytes.size() / 4);
  std::memcpy(words.data(), bytes.data(), bytes.size());
  std::uniform_int_distribution<int> steps(-255, 255);  // k / 256: exact in bf16 and f16
  std::vector<float> s(static_cast<size_t>(c.n) * groups), b(s.size());
  for (size_t i = 0; i < s.size(); ++i) s[i] = steps(rng) / 256.0f, b[i] = steps(rng) / 256.0f;
  std::vector<uint16_t> s16(s.size()), b16(s.size());
  for (size_t i = 0; i < s.size(); ++i) s16[i] = to_half_bits(s[i], c.type), b16[i] = to_half_bits(b[i], c.type);
  const bool f32 = c.type == ScaleType::f32;
  const QuantizedMatrix w{words.data(), f32 ? static_cast<const void*>(s.data()) : s16.data(),
                          f32 ? static_cast<const void*>(b.data()) : b16.data(), c.type, c.n, c.k, c.bits, c.group};
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(c.m) * c.k);
  for (auto& e : x) e = normal(rng);

  auto q_at = [&](int n, int j) {
    const uint8_t byte = bytes[static_cast<size_t>(n) * c.k * c.bits / 8 + j * c.bits / 8];
    return c.bits == 8 ? byte : (byte >> (4 * (j & 1))) & 0xf;
  };
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
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
