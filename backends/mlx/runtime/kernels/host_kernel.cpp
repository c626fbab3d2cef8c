#include "kernels/host_kernel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/ops.h>
#include <mlx/primitives.h>
#include <mlx/stream.h>

#include "kernels/known_values.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

class HostKernel : public mx::UnaryPrimitive {
 public:
  HostKernel(mx::Stream stream, const char* name, HostLoop loop, bool may_reuse_input0)
      : mx::UnaryPrimitive(stream), name_(name), loop_(std::move(loop)), may_reuse_input0_(may_reuse_input0) {}

  // Dispatched through the stream's command encoder as MLX's CPU primitives are (arg_reduce.cpp):
  // the buffers are set here, the loop runs later on the stream's worker, after its operands.
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const bool reuse = may_reuse_input0_ && !inputs.empty() && inputs[0].is_donatable() &&
                       inputs[0].dtype() == out.dtype() && inputs[0].nbytes() == out.nbytes() &&
                       inputs[0].flags().row_contiguous;
    if (reuse) {
      out.copy_shared_buffer(inputs[0]);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> in;
    in.reserve(inputs.size());
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
      in.push_back(mx::array::unsafe_weak_copy(a));
    }
    encoder.set_output_array(out);
    encoder.dispatch([in = std::move(in), out = mx::array::unsafe_weak_copy(out), loop = loop_]() mutable {
      loop(in, out);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string(name_) +
                             ": a host loop of the cpu kernel set cannot run on a GPU stream (it is built on the "
                             "CPU stream; select the device kernel set for GPUs)");
  }

  const char* name() const override { return name_; }

 private:
  const char* name_;
  HostLoop loop_;
  bool may_reuse_input0_;
};

class HostKernelMulti : public mx::Primitive {
 public:
  HostKernelMulti(mx::Stream stream, const char* name, HostLoopMulti loop)
      : mx::Primitive(stream), name_(name), loop_(std::move(loop)) {}

  // As HostKernel::eval_cpu, for every output.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> in, out;
    in.reserve(inputs.size());
    out.reserve(outputs.size());
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
      in.push_back(mx::array::unsafe_weak_copy(a));
    }
    for (auto& o : outputs) {
      o.set_data(mx::allocator::malloc(o.nbytes()));
      encoder.set_output_array(o);
      out.push_back(mx::array::unsafe_weak_copy(o));
    }
    encoder.dispatch([in = std::move(in), out = std::move(out), loop = loop_]() mutable { loop(in, out); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name_) + ": a host loop of the cpu kernel set cannot run on a GPU stream");
  }

  const char* name() const override { return name_; }

 private:
  const char* name_;
  HostLoopMulti loop_;
};

}  // namespace

std::vector<mx::array> host_kernel_multi(const char* name, std::vector<mx::Shape> shapes, mx::Dtype dtype,
                                         std::vector<mx::array> inputs, HostLoopMulti loop) {
  const mx::Stream stream = mx::default_stream(mx::Device::cpu);
  const std::vector<mx::Dtype> dtypes(shapes.size(), dtype);
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<HostKernelMulti>(stream, name, std::move(loop)), inputs);
}

void copy_row_major(const mx::array& a, void* dst) {
  const auto* src = a.data<uint8_t>();
  const size_t item = a.itemsize();
  if (a.flags().row_contiguous) {
    std::memmove(dst, src, a.size() * item);  // as copy_output always did (an output may overlap a wrapped input)
    return;
  }
  auto* out = static_cast<uint8_t*>(dst);
  const int nd = static_cast<int>(a.ndim());
  std::vector<int> index(nd, 0);
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t at = 0;
    for (int d = 0; d < nd; ++d) at += static_cast<int64_t>(index[d]) * a.strides()[d];
    std::memcpy(out + i * item, src + at * static_cast<int64_t>(item), item);
    for (int d = nd - 1; d >= 0 && ++index[d] == a.shape(d); --d) index[d] = 0;
  }
}

const float* float_rows(const mx::array& x, std::vector<float>& copy) {
  if (x.flags().row_contiguous) return x.data<float>();
  copy.resize(x.size());
  copy_row_major(x, copy.data());
  return copy.data();
}

mx::array contiguous_operand(const mx::array& a) {
  if (a.status() != mx::array::Status::unscheduled && a.flags().row_contiguous) return a;
  return mx::contiguous(a);
}

mx::array flat_source(mx::array a) {
  // A broadcast repeats elements: not a regrouping.
  while (is_view(a) && std::strcmp(a.primitive().name(), "Broadcast") != 0) {
    mx::array in = a.inputs()[0];
    a = std::move(in);
  }
  return a;
}

std::optional<mx::array> host_rows(const mx::array& view, int rows) {
  // Through the lazy views the graph puts over an input (the exporter's reshape and broadcast of a knob): they
  // regroup its elements, or repeat its one element.
  mx::array a = view;
  while (is_view(a)) {
    mx::array in = a.inputs()[0];
    a = std::move(in);
  }
  if (a.status() != mx::array::Status::available || rows < 0 || a.dtype() != view.dtype()) return std::nullopt;
  const size_t item = a.itemsize(), n = static_cast<size_t>(rows);
  // One value for every row, or one per row (a view with as many elements as its source keeps their order).
  if (a.size() != 1 && !(a.size() == n && view.size() == n && a.flags().row_contiguous)) return std::nullopt;
  mx::array out(mx::allocator::malloc(std::max<size_t>(n * item, 1)), {rows}, a.dtype());
  const char* src = a.data<char>();
  char* dst = out.data<char>();
  if (a.size() == n) {
    std::memcpy(dst, src, n * item);
  } else {
    for (size_t r = 0; r < n; ++r) std::memcpy(dst + r * item, src, item);
  }
  return out;
}

void transpose_copy(const float* src, const mx::Shape& shape, const std::vector<int>& perm, float* dst) {
  const int nd = static_cast<int>(shape.size());
  // A permutation that keeps the order of the axes larger than 1 (a decode step's [B, 1, H, D] ->
  // [B, H, 1, D]) leaves the row-major order of the values as it is: one memcpy.
  int last = -1;
  bool same_order = true;
  for (int j = 0; j < nd && same_order; ++j) {
    if (shape[perm[j]] == 1) continue;
    same_order = perm[j] > last;
    last = perm[j];
  }
  if (same_order) {
    int64_t size = 1;
    for (int s : shape) size *= s;
    std::memcpy(dst, src, static_cast<size_t>(size) * sizeof(float));
    return;
  }
  std::vector<int64_t> stride(nd, 1);
  for (int d = nd - 2; d >= 0; --d) stride[d] = stride[d + 1] * shape[d + 1];
  std::vector<int> index(nd, 0);  // over dst's shape: dst dim j is src dim perm[j]
  int64_t size = 1;
  for (int s : shape) size *= s;
  for (int64_t i = 0; i < size; ++i) {
    int64_t at = 0;
    for (int j = 0; j < nd; ++j) at += index[j] * stride[perm[j]];
    dst[i] = src[at];
    for (int j = nd - 1; j >= 0 && ++index[j] == shape[perm[j]]; --j) index[j] = 0;
  }
}

mx::array host_kernel(const char* name, mx::Shape shape, mx::Dtype dtype, std::vector<mx::array> inputs,
                      HostLoop loop, bool may_reuse_input0) {
  // Always the CPU stream: the loop reads host memory, so even a forced ETMLX_KERNELS=cpu on a
  // GPU build runs it there (MLX orders it after operands computed on other streams).
  const mx::Stream stream = mx::default_stream(mx::Device::cpu);
  return mx::array(std::move(shape), dtype, std::make_shared<HostKernel>(stream, name, std::move(loop), may_reuse_input0),
                   std::move(inputs));
}

}  // namespace etmlx::kernels
