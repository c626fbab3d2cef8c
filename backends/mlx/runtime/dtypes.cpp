#include "dtypes.h"

namespace etmlx {

namespace mx = mlx::core;

namespace {

struct Row {
  fb::DType fb;
  mx::Dtype mlx;
  ETScalarType et;
  const char* name;
};

// One row per fb::DType, in enum order.
const Row kRows[] = {
    {fb::DType::Float32, mx::float32, ETScalarType::Float, "float32"},
    {fb::DType::Float16, mx::float16, ETScalarType::Half, "float16"},
    {fb::DType::BFloat16, mx::bfloat16, ETScalarType::BFloat16, "bfloat16"},
    {fb::DType::Int32, mx::int32, ETScalarType::Int, "int32"},
    {fb::DType::Int64, mx::int64, ETScalarType::Long, "int64"},
    {fb::DType::Bool, mx::bool_, ETScalarType::Bool, "bool"},
    {fb::DType::UInt8, mx::uint8, ETScalarType::Byte, "uint8"},
    {fb::DType::Int8, mx::int8, ETScalarType::Char, "int8"},
    {fb::DType::Int16, mx::int16, ETScalarType::Short, "int16"},
    {fb::DType::UInt32, mx::uint32, ETScalarType::UInt32, "uint32"},
};
constexpr int kNumRows = sizeof(kRows) / sizeof(kRows[0]);
static_assert(kNumRows == static_cast<int>(fb::DType::MAX) + 1,
              "dtypes.cpp: a DType was added to schema.fbs; add its row here");

const Row* row(fb::DType d) {
  const int i = static_cast<int>(d);
  if (i < 0 || i >= kNumRows) return nullptr;
  return &kRows[i];
}

}  // namespace

bool dtype_in_range(fb::DType d) { return row(d) != nullptr; }

const char* dtype_name(fb::DType d) {
  const Row* r = row(d);
  return r ? r->name : "?";
}

std::optional<mx::Dtype> to_mlx(fb::DType d) {
  const Row* r = row(d);
  if (!r) return std::nullopt;
  return r->mlx;
}

std::optional<ETScalarType> to_et(fb::DType d) {
  const Row* r = row(d);
  if (!r) return std::nullopt;
  return r->et;
}

std::optional<fb::DType> from_mlx(mx::Dtype d) {
  for (const Row& r : kRows) {
    if (r.mlx == d) return r.fb;
  }
  return std::nullopt;
}

size_t dtype_itemsize(fb::DType d) {
  const Row* r = row(d);
  return r ? r->mlx.size() : 0;
}

const char* mlx_dtype_name(mx::Dtype d) {
  for (const Row& r : kRows) {
    if (r.mlx == d) return r.name;
  }
  switch (d.val()) {
    case mx::Dtype::Val::uint16: return "uint16";
    case mx::Dtype::Val::uint64: return "uint64";
    case mx::Dtype::Val::float64: return "float64";
    case mx::Dtype::Val::complex64: return "complex64";
    default: return "?";
  }
}

}  // namespace etmlx
