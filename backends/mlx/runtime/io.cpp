#include "io.h"

#include "kernels/host_kernel.h"

#include <array>
#include <cstring>
#include <limits>

#include <executorch/runtime/core/exec_aten/util/dim_order_util.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/platform/log.h>
#include <mlx/allocator.h>
#include <mlx/ops.h>

namespace etmlx {

namespace mx = mlx::core;
using executorch::runtime::Error;

namespace {

const char* et_type_name(ETScalarType t) {
  return executorch::runtime::toString(t);
}

}  // namespace

Error wrap_input(const ETTensor& t, fb::DType expected, size_t index, bool copy, mx::array* out) {
  const auto want = to_et(expected);
  const auto mdt = to_mlx(expected);
  if (!want || !mdt) {
    ET_LOG(Error, "etmlx: input %zu has unknown dtype %d", index, static_cast<int>(expected));
    return Error::InvalidProgram;
  }
  if (t.scalar_type() != *want) {
    ET_LOG(Error, "etmlx: input %zu has dtype %s but the graph expects %s", index,
           et_type_name(t.scalar_type()), dtype_name(expected));
    return Error::InvalidArgument;
  }
  const auto sizes = t.sizes();
  const auto dim_order = t.dim_order();
  if (sizes.size() > 64) {
    ET_LOG(Error, "etmlx: input %zu has rank %zu", index, sizes.size());
    return Error::InvalidArgument;
  }
  if (dim_order.size() == sizes.size() &&
      !executorch::runtime::is_contiguous_dim_order(dim_order.data(), dim_order.size())) {
    ET_LOG(Error, "etmlx: input %zu is not in contiguous (default) dim order", index);
    return Error::InvalidArgument;
  }
  mx::Shape shape;
  uint64_t numel = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] < 0) {
      ET_LOG(Error, "etmlx: input %zu has negative size in dimension %zu", index, d);
      return Error::InvalidArgument;
    }
    shape.push_back(static_cast<int32_t>(sizes[d]));
    numel *= static_cast<uint64_t>(sizes[d]);
  }
  if (numel == 0) {
    *out = mx::zeros(shape, *mdt);
    return Error::Ok;
  }
  void* data = const_cast<void*>(t.const_data_ptr());
  if (data == nullptr) {
    ET_LOG(Error, "etmlx: input %zu has no data", index);
    return Error::InvalidArgument;
  }
  if (t.nbytes() != numel * mdt->size()) {
    ET_LOG(Error, "etmlx: input %zu holds %zu bytes, expected %llu", index, t.nbytes(),
           static_cast<unsigned long long>(numel * mdt->size()));
    return Error::InvalidArgument;
  }
  if (copy) {
    mx::array owned(mx::allocator::malloc(t.nbytes()), std::move(shape), *mdt);
    std::memcpy(owned.data<uint8_t>(), data, t.nbytes());
    *out = std::move(owned);
    return Error::Ok;
  }
  // No copy; the no-op deleter leaves ownership with ExecuTorch. The array is
  // not "owned" by mlx, so mlx never donates (writes into) this memory.
  *out = mx::array(data, std::move(shape), *mdt, [](void*) {});
  return Error::Ok;
}

Error prepare_output(const ETTensor& t, const mx::array& a, fb::DType expected, size_t index) {
  const auto want_et = to_et(expected);
  const auto want_mlx = to_mlx(expected);
  if (!want_et || !want_mlx) {
    ET_LOG(Error, "etmlx: output %zu has unknown dtype %d", index, static_cast<int>(expected));
    return Error::InvalidProgram;
  }
  if (a.dtype() != *want_mlx) {
    ET_LOG(Error, "etmlx: output %zu was computed as %s but the graph declares %s", index,
           mlx_dtype_name(a.dtype()), dtype_name(expected));
    return Error::InvalidProgram;
  }
  if (t.scalar_type() != *want_et) {
    ET_LOG(Error, "etmlx: output tensor %zu has dtype %s but the graph declares %s", index,
           et_type_name(t.scalar_type()), dtype_name(expected));
    return Error::InvalidArgument;
  }
  const auto& shape = a.shape();
  if (static_cast<size_t>(t.dim()) != shape.size()) {
    ET_LOG(Error, "etmlx: output %zu has rank %zu but the output tensor has rank %zd", index,
           shape.size(), t.dim());
    return Error::InvalidArgument;
  }
  if (shape.size() > executorch::runtime::kTensorDimensionLimit) {
    ET_LOG(Error, "etmlx: output %zu has rank %zu (max %zu)", index, shape.size(),
           static_cast<size_t>(executorch::runtime::kTensorDimensionLimit));
    return Error::InvalidArgument;
  }
  std::array<executorch::runtime::etensor::TensorImpl::SizesType,
             executorch::runtime::kTensorDimensionLimit>
      sizes{};
  bool same = true;
  for (size_t d = 0; d < shape.size(); ++d) {
    sizes[d] = shape[d];
    if (t.size(static_cast<ssize_t>(d)) != shape[d]) same = false;
  }
  if (!same) {
    Error err = executorch::runtime::resize_tensor(t, {sizes.data(), shape.size()});
    if (err != Error::Ok) {
      ET_LOG(Error, "etmlx: cannot resize output %zu to the computed shape (error 0x%x)",
             index, static_cast<unsigned>(err));
      return err;
    }
  }
  return Error::Ok;
}

Error copy_output(const ETTensor& t, const mx::array& a, size_t index) {
  const size_t nbytes = a.nbytes();
  if (t.nbytes() != nbytes) {
    ET_LOG(Error, "etmlx: output %zu: tensor holds %zu bytes but the result has %zu", index,
           t.nbytes(), nbytes);
    return Error::Internal;
  }
  if (nbytes == 0) return Error::Ok;
  void* dst = t.mutable_data_ptr();
  if (dst == nullptr || a.data<uint8_t>() == nullptr) {
    ET_LOG(Error, "etmlx: output %zu has no data buffer", index);
    return Error::Internal;
  }
  // Through its strides when it is a view (a transpose, a broadcast, a slice): done here rather than by an
  // mx::contiguous node per output, which every call would ask MLX for although nearly every output (a token, a
  // host loop's result) is already row-contiguous.
  kernels::copy_row_major(a, dst);
  return Error::Ok;
}

}  // namespace etmlx
