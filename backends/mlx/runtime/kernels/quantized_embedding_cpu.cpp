// quantized_embedding.h: built with -ffp-contract=off (CMakeLists.txt), so q * scale + bias stays two
// rounded operations, as MLX's multiply and add nodes compute it.
#include "kernels/quantized_embedding.h"

#include <cstdint>
#include <vector>

#include "kernels/host_kernel.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

// Index i (row-major) of an integer array in any layout, as int64.
int64_t index_at(const mx::array& a, size_t i) {
  size_t at = 0;
  for (int d = static_cast<int>(a.ndim()) - 1; d >= 0; --d) {
    const size_t size = static_cast<size_t>(a.shape(d));
    at += (i % size) * static_cast<size_t>(a.strides()[d]);
    i /= size;
  }
  switch (a.dtype()) {
    case mx::int32: return a.data<int32_t>()[at];
    case mx::int64: return a.data<int64_t>()[at];
    case mx::uint32: return a.data<uint32_t>()[at];
    case mx::uint64: return static_cast<int64_t>(a.data<uint64_t>()[at]);
    default: return 0;  // excluded by the caller
  }
}

// One looked-up row after another: q in the scales' type T, times its scale, plus its bias, each a T
// operation (MLX's dequantize: a cast, a multiply and an add in the scales' dtype; MLX's bfloat16 and float16
// operators compute in float32 and round the result, as these do).
template <typename T>
void lookup_rows(const mx::array& r, const mx::array& w, const mx::array& scales, const mx::array& biases, int k,
                 int group_size, int bits, mx::array& o) {
  const int per_word = 32 / bits, words = k / per_word, groups = k / group_size;
  const uint32_t* wp = w.data<uint32_t>();
  const T *sp = scales.data<T>(), *bp = biases.data<T>();
  const uint32_t mask = (1u << bits) - 1;
  T* dst = o.data<T>();
  for (size_t i = 0; i < r.size(); ++i, dst += k) {
    const int64_t row = index_at(r, i);
    const uint32_t* wr = wp + row * words;
    const T *s = sp + row * groups, *b = bp + row * groups;
    for (int j = 0; j < k; ++j) {
      const T q = static_cast<T>(static_cast<float>((wr[j / per_word] >> (bits * (j % per_word))) & mask));
      const T scaled = q * s[j / group_size];
      dst[j] = scaled + b[j / group_size];
    }
  }
}

}  // namespace

bool quantized_embedding_cpu(const mx::array& rows, const mx::array& w, const mx::array& scales,
                             const mx::array& biases, int group_size, int bits, mx::array* out) {
  const bool int_rows = rows.dtype() == mx::int32 || rows.dtype() == mx::int64 || rows.dtype() == mx::uint32 ||
                        rows.dtype() == mx::uint64;
  const mx::Dtype dtype = scales.dtype();
  const bool floats = dtype == mx::float32 || dtype == mx::bfloat16 || dtype == mx::float16;
  if ((bits != 2 && bits != 4 && bits != 8) || !floats || biases.dtype() != dtype || !int_rows || w.ndim() != 2 ||
      rows.size() == 0) {
    return false;
  }
  const int per_word = 32 / bits;
  const int k = static_cast<int>(w.shape(1)) * per_word;
  mx::Shape shape = rows.shape();
  shape.push_back(k);
  // The weights are constants (materialised, row-contiguous) in every program the exporter writes; any
  // other layout keeps MLX's op.
  for (const mx::array* a : {&w, &scales, &biases}) {
    if (a->status() == mx::array::Status::unscheduled || !a->flags().row_contiguous) return false;
  }
  auto loop = [k, group_size, bits, dtype](const std::vector<mx::array>& in, mx::array& o) {
    if (dtype == mx::bfloat16) {
      lookup_rows<mx::bfloat16_t>(in[0], in[1], in[2], in[3], k, group_size, bits, o);
    } else if (dtype == mx::float16) {
      lookup_rows<mx::float16_t>(in[0], in[1], in[2], in[3], k, group_size, bits, o);
    } else {
      lookup_rows<float>(in[0], in[1], in[2], in[3], k, group_size, bits, o);
    }
  };
  *out = host_kernel("QuantizedEmbeddingCpu", std::move(shape), dtype, {rows, w, scales, biases}, loop);
  return true;
}

}  // namespace etmlx::kernels
