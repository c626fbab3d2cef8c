// quantized_gemm_vnni.h: the integer-activation GEMM on AVX-512 VNNI (functions with their own target
// attribute, so the library stays baseline x86-64).
#include "kernels/quantized_gemm_vnni.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#include "kernels/quantized_rows_variants.h"
#include "kernels/thread_pool.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see quantized_rows_x86.cpp)
#endif

#include <immintrin.h>

#include "kernels/quantized_activations_avx512.h"

namespace etmlx::kernels {

namespace {

#define ETMLX_INLINE inline __attribute__((always_inline))

// 4 bytes of one activation row read as the int32 that vpdpbusd broadcasts.
typedef int32_t __attribute__((may_alias)) word_t;

// Register tile: one vector of 16 W rows times kTileX = 12 activation rows: 12 int32 accumulators for a
// group's integer sums and 12 float32 ones for the output, the weight vector and the group's scales and
// biases fit the 32 registers; per 4 k values 12 vpdpbusd, each with its activation bytes broadcast from
// memory by the instruction. Measured on one thread (Zen 5, int8, 512 x 896 x 4864 and 512 x 4864 x 896):
// ~10% faster than 2 vectors of W rows x 12 activation rows (24 int32 accumulators, whose per-group float32
// terms then had to go through L1); 10 or 14 activation rows: the same within the noise.
constexpr int kTileW = 16;
constexpr int kTileX = 12;
constexpr int kStepBytesW = kTileW * 4;  // one k step (4 values) of a W tile
constexpr int kStepBytesX = kTileX * 4;  // one k step of an activation panel

// A thread's W block: about 512 KB of bytes and scales (in a 1-2 MB L2), 2 to 32 tiles of 16 rows.
constexpr int64_t kBufferBytes = 1 << 19;
int64_t tile_bytes(int k, int groups) { return int64_t{kTileW} * k + 2 * int64_t{groups} * kTileW * 4; }

// Unpacked tile i of a thread's buffer: its bytes [k / 4][16][4], then its scales and biases [groups][16] (float32).
struct TileSlot {
  uint8_t* bytes;
  float* scales;
  float* biases;
  TileSlot(char* buf, int i, int k, int groups)
      : bytes(reinterpret_cast<uint8_t*>(buf + i * tile_bytes(k, groups))),
        scales(reinterpret_cast<float*>(bytes + int64_t{kTileW} * k)),
        biases(scales + int64_t{groups} * kTileW) {}
};
int tiles_per_block(int k, int groups) {
  return static_cast<int>(std::clamp<int64_t>(kBufferBytes / tile_bytes(k, groups), 2, 32));
}

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<char[], AlignedFree>;

// A buffer of at least `bytes`, kept in `buf` between calls (a fresh one per linear costs page faults).
char* reserve(Buffer& buf, size_t& have, size_t bytes) {
  if (have < bytes) {
    const size_t size = std::max<size_t>((bytes + 63) / 64 * 64, 64);
    char* p = static_cast<char*>(std::aligned_alloc(64, size));
    if (p == nullptr) throw std::bad_alloc();
    buf.reset(p);
    have = size;
  }
  return buf.get();
}

// The order of a 32-value chunk in both operands: natural for 8 bits; for 4 bits the even values (the
// low nibbles of the chunk's 16 bytes) then the odd ones, so that unpacking W needs no interleave.
// Within a group the order of the products does not matter: their sum is exact.

// Activations, per panel of kTileX rows: planes (int16: hi then lo; int8: one) of [k / 4][kTileX][4]
// bytes, then per group and row three float32 values: the step, the sum of x, and the residual
// sum_i (x_i - step * q_i), the rounding the integers left (quantized_gemm_vnni.h: it meets the centred
// weights).
constexpr int kScalars = 3 * kTileX;  // per panel and group: steps [kTileX], sums [kTileX], residuals [kTileX]
struct Activations {
  int8_t* bytes;    // [panels][planes][k * kTileX]
  float* scalars;   // [panels][groups][kScalars]
  int planes, groups;
  int64_t panel_bytes() const { return int64_t{planes} * plane_bytes; }
  int64_t plane_bytes;
};

// Group g of row r of a panel from x (the group's `group` values; null: a padding row of zeros):
// quantize_activation_group's integers (quantized_activations_avx512.h). The caller goes through a panel
// group by group, its rows in turn, so the 4-byte stores stay within the group's few hundred bytes of it.
template <int BITS, bool INT16>
ETMLX_VNNI_TARGET void prepare_group(const float* x, int group, int g, int8_t* panel, int64_t plane_bytes, float* scalars,
                              int r) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const avx512::GroupRounding rounding = avx512::group_rounding(x, group, INT16 ? kInt16Max : kInt8Max);
  float* out_scalars = scalars + g * kScalars + r;
  out_scalars[0] = rounding.step;
  out_scalars[kTileX] = rounding.sum;
  __m512 residual = _mm512_setzero_ps();  // x - step * q, each rounded once
  for (int c = 0; c < group; c += 32) {
    __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
    if (!rounding.zero) {
      q0 = rounding.round(_mm512_loadu_ps(x + c), residual);
      q1 = rounding.round(_mm512_loadu_ps(x + c + 16), residual);
    }
    __m512i a = q0, b = q1;
    if constexpr (BITS == 4) {
      a = _mm512_permutex2var_epi32(q0, even, q1);
      b = _mm512_permutex2var_epi32(q0, odd, q1);
    }
    const int64_t step0 = (static_cast<int64_t>(g) * group + c) / 4;  // the chunk's first k step
    __m512i planes[2][2] = {{a, b}, {a, b}};  // int16: hi then lo; int8: q
    if constexpr (INT16) {
      avx512::split_int16(a, planes[0][0], planes[1][0]);
      avx512::split_int16(b, planes[0][1], planes[1][1]);
    }
    for (int plane = 0; plane < (INT16 ? 2 : 1); ++plane) {
      alignas(16) int32_t words[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(words), _mm512_cvtepi32_epi8(planes[plane][0]));
      _mm_store_si128(reinterpret_cast<__m128i*>(words + 4), _mm512_cvtepi32_epi8(planes[plane][1]));
      int8_t* out = panel + plane * plane_bytes + (step0 * kTileX + r) * 4;
      for (int j = 0; j < 8; ++j) std::memcpy(out + j * kStepBytesX, &words[j], 4);
    }
  }
  // Non-finite x: NaN, as the step. A zero or padding group: 0.
  out_scalars[2 * kTileX] = avx512::group_residual(rounding, residual);
}

// Unpacks W rows n0 .. n0 + 15 (rows past w.n: 0) into wt [k / 4][16][4] bytes and their scales and
// biases into sc, bi [groups][16]. Per 32 k values: each row's 32 bytes in chunk order (8 words: one k step
// each), then a 16 x 8 transpose of those words in registers, 8 stores of 64 bytes. A store per row and
// word (128 per chunk) made this unpack as slow as a 12-row product of the tile, which is what a verify
// call of 9 rows pays per W row.
// Two rows' chunks (32 values each, in chunk order; see above; a and b point at the chunks' first bytes) as
// [a's 8 words | b's 8 words].
template <int BITS>
ETMLX_VNNI_TARGET ETMLX_INLINE __m512i chunk_pair(const uint8_t* a, const uint8_t* b) {
  if constexpr (BITS == 4) {
    const __m256i bytes =
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
    // [a a b b] in 128-bit quarters, then the low nibbles of the even quarters, the high ones of the odd.
    const __m512i twice = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                                   _mm512_castsi256_si512(bytes));
    constexpr long long four = 0x0004000400040004LL;  // a shift of 4 in each 16-bit lane
    const __m512i shifts = _mm512_setr_epi64(0, 0, four, four, 0, 0, four, four);
    return _mm512_and_si512(_mm512_srlv_epi16(twice, shifts), _mm512_set1_epi8(0x0f));
  } else {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
  }
}

template <int BITS, ScaleType T>
ETMLX_VNNI_TARGET void unpack_tile(const QuantizedMatrix& w, int n0, uint8_t* wt, float* sc, float* bi) {
  const int groups = w.k / w.group;
  const int64_t row_bytes = static_cast<int64_t>(w.k) * BITS / 8;
  const int rows = std::min(kTileW, w.n - n0);
  const uint8_t* w0 = reinterpret_cast<const uint8_t*>(w.w) + n0 * row_bytes;
  alignas(64) static const uint8_t zeros[32] = {};  // a chunk of the rows past w.n
  // Output word j of the chunk gathers 128-bit quarters of the transposed pairs (see below).
  const __m512i take_low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i take_high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int c = 0; c < w.k; c += 32) {
    const int64_t at = int64_t{c} * BITS / 8;  // the chunk's first byte in a row
    if (at % 64 == 0) {
      // 16 rows read side by side, W straight from memory in a prefill (each weight read once per call):
      // fetched 512 bytes ahead, which the hardware prefetcher does not do for that many streams.
      for (int rr = 0; rr < rows; ++rr) _mm_prefetch(reinterpret_cast<const char*>(w0 + rr * row_bytes + at + 512), _MM_HINT_T0);
    }
    // z[r] = [row r's 8 words | row r + 8's 8 words], r < 8.
    __m512i z[8];
    for (int r = 0; r < 8; ++r) {
      const uint8_t* a = r < rows ? w0 + r * row_bytes + at : zeros;
      const uint8_t* b = r + 8 < rows ? w0 + (r + 8) * row_bytes + at : zeros;
      z[r] = chunk_pair<BITS>(a, b);
    }
    // The 8 x 8 word transpose of each 256-bit half at once (unpacks work within 128-bit quarters):
    // u[j] holds rows 0-3 (or 4-7 for u[4 + j]) of words j and j + 4 in its quarters 0 and 1, rows 8-11
    // (12-15) in quarters 2 and 3.
    __m512i t[8], u[8];
    for (int p = 0; p < 4; ++p) {
      t[2 * p] = _mm512_unpacklo_epi32(z[2 * p], z[2 * p + 1]);
      t[2 * p + 1] = _mm512_unpackhi_epi32(z[2 * p], z[2 * p + 1]);
    }
    for (int half = 0; half < 2; ++half) {  // rows 0-3 (8-11), then rows 4-7 (12-15)
      const __m512i* tt = t + 4 * half;
      u[4 * half + 0] = _mm512_unpacklo_epi64(tt[0], tt[2]);
      u[4 * half + 1] = _mm512_unpackhi_epi64(tt[0], tt[2]);
      u[4 * half + 2] = _mm512_unpacklo_epi64(tt[1], tt[3]);
      u[4 * half + 3] = _mm512_unpackhi_epi64(tt[1], tt[3]);
    }
    uint8_t* out = wt + static_cast<int64_t>(c / 4) * kStepBytesW;
    for (int j = 0; j < 4; ++j) {
      _mm512_store_si512(out + j * kStepBytesW, _mm512_permutex2var_epi64(u[j], take_low, u[4 + j]));
      _mm512_store_si512(out + (j + 4) * kStepBytesW, _mm512_permutex2var_epi64(u[j], take_high, u[4 + j]));
    }
  }
  for (int rr = 0; rr < kTileW; ++rr) {
    for (int g = 0; g < groups; ++g) {
      const int64_t at = static_cast<int64_t>(n0 + rr) * groups + g;
      sc[g * kTileW + rr] = rr < rows ? load_scale<T>(w.scales, at) : 0.0f;
      bi[g * kTileW + rr] = rr < rows ? load_scale<T>(w.biases, at) : 0.0f;
    }
  }
}

// acc + the 4-byte dot products of w's unsigned bytes and the signed bytes at p (broadcast to every int32
// lane, {1to16}). As inline assembly: GCC 12 copies the accumulator of _mm512_dpbusd_epi32 into a fresh
// register and back, which with this many accumulators spilled a register per instruction (measured 1.3x
// slower), and does not fold the broadcast into the instruction.
ETMLX_VNNI_TARGET ETMLX_INLINE __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const word_t*>(p)));
  return acc;
}

// The tile's accumulators are named variables, one macro expansion per activation row: GCC 12 kept an
// array of them on the stack (a store per vpdpbusd), even fully unrolled.
#define ETMLX_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
static_assert(kTileX == 12, "ETMLX_ROWS names kTileX rows");

// The packed W rows of the tile a single-panel product multiplies next, fetched into cache group by group
// while the kernel multiplies the current tile: a verify call (one panel) unpacks each tile right before its
// product, so without this every tile's unpack waits on memory while the cores have nothing to multiply.
struct NextTile {
  const uint8_t* w;   // its first row's bytes
  int64_t row_bytes;  // between its rows
  int rows;           // its rows (<= kTileW)
  int group_bytes;    // one group's bytes in a row
  ETMLX_VNNI_TARGET ETMLX_INLINE void fetch(int g) const {
    for (int r = 0; r < rows; ++r) {
      const uint8_t* p = w + r * row_bytes + int64_t{g} * group_bytes;
      for (int at = 0; at < group_bytes; at += 32) _mm_prefetch(reinterpret_cast<const char*>(p + at), _MM_HINT_T0);
    }
  }
};

// c[r][j] = activation row r of the panel . W tile row j for r < ROWS (1..kTileX: a panel's real rows, so a
// verify call of 9 rows does not pay for 12): per group, the integer sums acc[r] (lane j: W row j), then one
// float32 multiply and three multiply-adds:
// c += (acc * scale) * step + bias * sum(x) + (centre * scale) * residual, centre = 2^(bits-1).
template <bool INT16, int ROWS>
ETMLX_VNNI_TARGET void tile_kernel(const uint8_t* wt, const float* sc, const float* bi, const int8_t* panel,
                            int64_t plane_bytes, const float* scalars, float centre, int k, int group,
                            const NextTile* next, float (&c)[kTileX][kTileW]) {
#define ETMLX_CDECL(r) __m512 c##r = _mm512_setzero_ps();
  ETMLX_ROWS(ETMLX_CDECL)
  const int per_group = group / 4, groups = k / group;
  for (int g = 0; g < groups; ++g) {
    if (next != nullptr) next->fetch(g);
#define ETMLX_DECLARE(r) __m512i acc##r = _mm512_setzero_si512();
    ETMLX_ROWS(ETMLX_DECLARE)
    const uint8_t* wg = wt + static_cast<int64_t>(g) * per_group * kStepBytesW;
    const int8_t* ag = panel + static_cast<int64_t>(g) * per_group * kStepBytesX;
#define ETMLX_DOT(r) if constexpr ((r) < ROWS) acc##r = dpbusd_bcast(acc##r, w0, a + 4 * (r));
    for (int plane = 0; plane < (INT16 ? 2 : 1); ++plane) {
      if (plane == 1) {  // int16: 256 * (qw . hi) + qw . lo
#define ETMLX_SHIFT(r) if constexpr ((r) < ROWS) acc##r = _mm512_slli_epi32(acc##r, 8);
        ETMLX_ROWS(ETMLX_SHIFT)
      }
      const uint8_t* w = wg;
      const int8_t* a = ag + plane * plane_bytes;
      for (int s = 0; s < per_group; ++s, w += kStepBytesW, a += kStepBytesX) {
        const __m512i w0 = _mm512_load_si512(w);
        ETMLX_ROWS(ETMLX_DOT)
      }
    }
    const __m512 s0 = _mm512_load_ps(sc + g * kTileW), b0 = _mm512_load_ps(bi + g * kTileW);
    const __m512 cs0 = _mm512_mul_ps(s0, _mm512_set1_ps(centre));  // exact: a power of 2
    const float* st = scalars + g * kScalars;
    const float* su = st + kTileX;
    const float* re = st + 2 * kTileX;
#define ETMLX_TERM(r) \
    if constexpr ((r) < ROWS) { \
    c##r = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc##r), s0), _mm512_set1_ps(st[r]), c##r); \
    c##r = _mm512_fmadd_ps(b0, _mm512_set1_ps(su[r]), c##r); \
    c##r = _mm512_fmadd_ps(cs0, _mm512_set1_ps(re[r]), c##r); \
    }
    ETMLX_ROWS(ETMLX_TERM)
  }
#define ETMLX_SAVE(r) if constexpr ((r) < ROWS) _mm512_store_ps(c[r], c##r);
  ETMLX_ROWS(ETMLX_SAVE)
#undef ETMLX_CDECL
#undef ETMLX_DECLARE
#undef ETMLX_DOT
#undef ETMLX_SHIFT
#undef ETMLX_TERM
#undef ETMLX_SAVE
}

template <bool INT16>
using TileKernel = void (*)(const uint8_t*, const float*, const float*, const int8_t*, int64_t, const float*, float,
                            int, int, const NextTile*, float (&)[kTileX][kTileW]);

// tile_kernel<INT16, rows> at index rows - 1.
template <bool INT16, int... R>
constexpr std::array<TileKernel<INT16>, sizeof...(R)> tile_kernels(std::integer_sequence<int, R...>) {
  return {&tile_kernel<INT16, R + 1>...};
}

struct Gemm {
  const QuantizedMatrix& w;
  const Activations& a;
  int m;
  float* out;

  // c's rows m0 .. m0 + rows_x - 1 of W tile t into out.
  ETMLX_VNNI_TARGET void store(int t, int m0, int rows_x, const float (&c)[kTileX][kTileW]) const {
    const int n0 = t * kTileW, rows_w = std::min(kTileW, w.n - n0);
    const __mmask16 mask = static_cast<__mmask16>(rows_w >= 16 ? 0xffff : (1u << rows_w) - 1);
    for (int r = 0; r < rows_x; ++r) {
      _mm512_mask_storeu_ps(out + static_cast<int64_t>(m0 + r) * w.n + n0, mask, _mm512_load_ps(c[r]));
    }
  }

  // W tiles [t0, t1) (tile t = rows 16 t .. 16 t + 15), for every activation row: the block's tiles unpacked
  // once, then multiplied by each panel; a single panel (a verify call, a short prompt) unpacks each tile
  // right before its product instead, with the next tile's bytes fetched during it (NextTile).
  template <int BITS, ScaleType T, bool INT16>
  ETMLX_VNNI_TARGET void tiles(int t0, int t1, char* buf) const {
    const int groups = w.k / w.group;
    const int64_t row_bytes = static_cast<int64_t>(w.k) * BITS / 8;
    static constexpr auto kernels = tile_kernels<INT16>(std::make_integer_sequence<int, kTileX>());
    const float centre = 1 << (BITS - 1);
    if (m <= kTileX) {
      const TileKernel<INT16> kernel = kernels[m - 1];
      const TileSlot tile(buf, 0, w.k, groups);
      for (int t = t0; t < t1; ++t) {
        unpack_tile<BITS, T>(w, t * kTileW, tile.bytes, tile.scales, tile.biases);
        const int n1 = (t + 1) * kTileW;
        const NextTile next{reinterpret_cast<const uint8_t*>(w.w) + n1 * row_bytes, row_bytes,
                            std::min(kTileW, w.n - n1), w.group * BITS / 8};
        alignas(64) float c[kTileX][kTileW];
        kernel(tile.bytes, tile.scales, tile.biases, a.bytes, a.plane_bytes, a.scalars, centre, w.k, w.group,
               t + 1 < t1 ? &next : nullptr, c);
        store(t, 0, m, c);
      }
      return;
    }
    for (int t = t0; t < t1; ++t) {
      const TileSlot tile(buf, t - t0, w.k, groups);
      unpack_tile<BITS, T>(w, t * kTileW, tile.bytes, tile.scales, tile.biases);
    }
    for (int m0 = 0, p = 0; m0 < m; m0 += kTileX, ++p) {
      const int8_t* panel = a.bytes + p * a.panel_bytes();
      const float* scalars = a.scalars + static_cast<int64_t>(p) * groups * kScalars;
      const int rows_x = std::min(kTileX, m - m0);
      const TileKernel<INT16> kernel = kernels[rows_x - 1];
      for (int t = t0; t < t1; ++t) {
        const TileSlot tile(buf, t - t0, w.k, groups);
        alignas(64) float c[kTileX][kTileW];
        kernel(tile.bytes, tile.scales, tile.biases, panel, a.plane_bytes, scalars, centre, w.k, w.group, nullptr, c);
        store(t, m0, rows_x, c);
      }
    }
  }
};

template <int BITS, bool INT16>
ETMLX_VNNI_TARGET void run(const float* x, int m, const QuantizedMatrix& w, float* out) {
  const int groups = w.k / w.group, panels = (m + kTileX - 1) / kTileX;
  // Kept between calls, on the thread that makes them (MLX's CPU thread), as the float GEMM's panels.
  thread_local Buffer act_buf, scalar_buf;
  thread_local size_t act_have = 0, scalar_have = 0;
  Activations a{};
  a.planes = INT16 ? 2 : 1;
  a.groups = groups;
  a.plane_bytes = static_cast<int64_t>(w.k) * kTileX;
  a.bytes = reinterpret_cast<int8_t*>(reserve(act_buf, act_have, static_cast<size_t>(panels) * a.panel_bytes()));
  a.scalars = reinterpret_cast<float*>(
      reserve(scalar_buf, scalar_have, sizeof(float) * static_cast<size_t>(panels) * groups * kScalars));
  auto prepare = [&](int p0, int p1) {
    for (int p = p0; p < p1; ++p) {
      for (int g = 0; g < groups; ++g) {
        for (int r = 0; r < kTileX; ++r) {
          const int row = p * kTileX + r;
          if (row < m && g + 4 < groups) {  // 12 rows of x read side by side: fetched 4 groups ahead (halved this
            // loop's time at k = 4864, where x is 10 MB)
            const float* ahead = x + static_cast<int64_t>(row) * w.k + static_cast<int64_t>(g + 4) * w.group;
            for (int i = 0; i < w.group; i += 16) _mm_prefetch(reinterpret_cast<const char*>(ahead + i), _MM_HINT_T0);
          }
          prepare_group<BITS, INT16>(row < m ? x + static_cast<int64_t>(row) * w.k + static_cast<int64_t>(g) * w.group
                                             : nullptr,
                                     w.group, g, a.bytes + p * a.panel_bytes(), a.plane_bytes,
                                     a.scalars + static_cast<int64_t>(p) * groups * kScalars, r);
        }
      }
    }
  };
  parallel_for(panels, 1, prepare);
  const Gemm gemm{w, a, m, out};
  const int tiles = (w.n + kTileW - 1) / kTileW;
  const int per_block = tiles_per_block(w.k, groups);
  // At least two ranges per thread, so that a thread the shared machine slows does not hold up the rest.
  const int grain = std::clamp(tiles / (2 * pool_threads()), 1, per_block);
  auto range = [&](int t0, int t1) {
    thread_local Buffer buf;
    thread_local size_t have = 0;
    char* b = reserve(buf, have, static_cast<size_t>(per_block * tile_bytes(w.k, groups)));
    for (int t = t0; t < t1; t += per_block) {
      const int t_end = std::min(t1, t + per_block);
      dispatch_dequantize(BITS, w.scale_type, [&]<int B, ScaleType T>() {
        if constexpr (B == BITS) gemm.tiles<BITS, T, INT16>(t, t_end, b);
      });
    }
  };
  parallel_for(tiles, grain, range);
}

}  // namespace

bool quantized_gemm_vnni_available(int bits, int group) {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx2") &&
                          __builtin_cpu_supports("fma");
  return cpu && (bits == 4 || bits == 8) && (group == 32 || group == 64 || group == 128);
}

void quantized_gemm_vnni(const float* x, int m, const QuantizedMatrix& w, ActivationPrecision p, float* out) {
  const bool int16 = p == ActivationPrecision::int16;
  if (w.bits == 4) {
    int16 ? run<4, true>(x, m, w, out) : run<4, false>(x, m, w, out);
  } else if (w.bits == 8) {
    int16 ? run<8, true>(x, m, w, out) : run<8, false>(x, m, w, out);
  } else {
    std::abort();  // quantized_gemm() sends only 4 and 8 bits here
  }
}

}  // namespace etmlx::kernels

#else  // not x86-64: no VNNI; quantized_gemm() keeps float32

namespace etmlx::kernels {
bool quantized_gemm_vnni_available(int, int) { return false; }
void quantized_gemm_vnni(const float*, int, const QuantizedMatrix&, ActivationPrecision, float*) { std::abort(); }
}  // namespace etmlx::kernels

#endif
