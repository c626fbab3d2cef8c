// The many-row quantized product (kernels/quantized_gemm.h) against a double-precision reference from
// the packed layout, over shapes that leave partial register tiles in both directions (rows not a
// multiple of 32, outputs not a multiple of 14), 4 and 8 bits, groups 32/64/128, every scale type,
// 1 and several pool threads; and each row equal bit for bit to the same row multiplied alone.
// Prints "skipped" where the CPU lacks AVX-512 (the library then keeps dequantize-then-BLAS), else
// "N passed, N failed"; exit status 1 on any failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/quantized_gemm.h"

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

void check(int m, int n, int k, int bits, int group, ScaleType type, std::mt19937& rng) {
  const int groups = k / group;
  std::vector<uint8_t> bytes(static_cast<size_t>(n) * k * bits / 8);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  std::vector<uint32_t> words(bytes.size() / 4);
  std::memcpy(words.data(), bytes.data(), bytes.size());
  std::uniform_int_distribution<int> steps(-255, 255);
  std::vector<float> s(static_cast<size_t>(n) * groups), b(s.size());
  for (size_t i = 0; i < s.size(); ++i) s[i] = steps(rng) / 256.0f, b[i] = steps(rng) / 256.0f;
  std::vector<uint16_t> s16(s.size()), b16(s.size());
  for (size_t i = 0; i < s.size(); ++i) s16[i] = to_half_bits(s[i], type), b16[i] = to_half_bits(b[i], type);
  const bool f32 = type == ScaleType::f32;
  const QuantizedMatrix w{words.data(), f32 ? static_cast<const void*>(s.data()) : s16.data(),
                          f32 ? static_cast<const void*>(b.data()) : b16.data(), type, n, k, bits, group};
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(m) * k), out(static_cast<size_t>(m) * n, NAN);
  for (auto& e : x) e = normal(rng);
  quantized_gemm(x.data(), m, w, out.data());

  auto q_at = [&](int row, int j) {
    const uint8_t byte = bytes[static_cast<size_t>(row) * k * bits / 8 + j * bits / 8];
    return bits == 8 ? byte : (byte >> (4 * (j & 1))) & 0xf;
  };
  double worst = 0.0;
  for (int r = 0; r < m; ++r) {
    for (int c = 0; c < n; ++c) {
      double ref = 0.0, mag = 0.0;
      for (int j = 0; j < k; ++j) {
        const double wv = double(s[c * groups + j / group]) * q_at(c, j) + b[c * groups + j / group];
        ref += wv * x[static_cast<size_t>(r) * k + j];
        mag += std::fabs(wv * x[static_cast<size_t>(r) * k + j]);
      }
      // float32 sums of k products: within k * 2^-24 of their magnitude (NaN, an unwritten output, fails).
      const double err = std::fabs(out[static_cast<size_t>(r) * n + c] - ref) / (mag * k * 6e-8 + 1e-30);
      worst = std::isnan(err) ? INFINITY : std::max(worst, err);
    }
  }
  bool invariant = true;  // a row alone gives the bits it has within the batch
  for (int r = 0; r < m; r += 7) {
    std::vector<float> alone(n);
    quantized_gemm(x.data() + static_cast<size_t>(r) * k, 1, w, alone.data());
    invariant = invariant && std::memcmp(alone.data(), out.data() + static_cast<size_t>(r) * n, sizeof(float) * n) == 0;
  }
  const bool ok = worst <= 1.0 && invariant;
  (ok ? passed : failed)++;
  if (!ok) {
    std::printf("FAIL m=%d n=%d k=%d bits=%d group=%d type=%d: error %.3g of bound, rows alone %s\n", m, n, k, bits,
                group, static_cast<int>(type), worst, invariant ? "equal" : "DIFFER");
  }
}

}  // namespace

int main() {
  if (!quantized_gemm_available()) {
    std::printf("skipped: no AVX-512 (or ETMLX_QMM_GEMM=blas / ETMLX_QMM_ISA set)\n");
    return 0;
  }
  std::mt19937 rng(11);
  for (int bits : {4, 8})
    for (int group : {32, 64, 128})
      for (ScaleType t : {ScaleType::f32, ScaleType::f16, ScaleType::bf16})
        for (auto [m, n] : {std::pair{16, 14}, std::pair{33, 29}, std::pair{70, 129}})
          check(m, n, 384, bits, group, t, rng);
  check(64, 300, 1024, 4, 64, ScaleType::bf16, rng);  // several W tiles per thread block
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
