// The sampling nodes: operands read and checked against the blob, then the kernels
// (kernels/random_bits.h, filter_threshold.h, gumbel_max.h) in the program's variant.
#include <mlx/ops.h>

#include "interpreter.h"
#include "kernels/host_kernel.h"
#include "kernels/kernel_set.h"
#include "kernels/known_values.h"
#include "kernels/random_bits.h"

namespace etmlx {

namespace mx = mlx::core;

namespace {

// [rows] float32 from a scalar or [rows] temperature. On the CPU a temperature the host holds (the call's input)
// is spread on the host: no graph node (host_kernel.h host_rows; on a CUDA GPU a host-made array costs more).
mx::array temperature_rows(const mx::array& t, int rows, bool cpu_set) {
  if (cpu_set) {
    if (std::optional<mx::array> held = kernels::host_rows(t, rows)) return *held;
  }
  return mx::broadcast_to(mx::reshape(t, {-1}), {rows});
}

}  // namespace

bool Interpreter::exec_random_bits(const fb::RandomBitsNode& n) {
  // The bits are lazy: write() refuses them before anything allocates them if they are too large.
  mx::Shape shape;
  if (!resolve_new_shape(n.shape(), &shape)) return false;
  const int width = n.width();
  if (width != 1 && width != 2 && width != 4) return fail("has unsupported width %d (1, 2 or 4)", width);

  std::optional<mx::array> seed;
  if (n.seed() != nullptr) {
    const mx::array* s = read(n.seed());
    if (!s) return false;
    if (!mx::issubdtype(s->dtype(), mx::integer)) return fail("seed must be an integer tensor");
    if (s->ndim() > 1) return fail("seed must be 0-d or 1-d, got %d dims", static_cast<int>(s->ndim()));
    seed = *s;
  }
  auto bits = kernels::random_bits(shape, width, seed);
  if (!bits) return fail("has %d per-row seeds but its shape does not start with %d", seed->shape(0), seed->shape(0));
  return write(n.out(), *bits);
}

bool Interpreter::exec_filter_threshold(const fb::FilterThresholdNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  const mx::array* temperature = read(n.temperature());
  if (!temperature) return false;
  if (x->ndim() != 2 || x->dtype() != mx::float32) return fail("x must be a [B, V] float32 tensor");
  const int rows = x->shape(0), vocab = x->shape(1);
  if (vocab == 0) return fail("x has an empty vocabulary");
  if (temperature->dtype() != mx::float32 ||
      (temperature->size() != 1 && temperature->size() != static_cast<size_t>(rows))) {
    return fail("temperature must be a float32 scalar or [%d]", rows);
  }
  kernels::FilterKnobs knobs;
  std::optional<mx::array>* slots[3] = {&knobs.top_k, &knobs.top_p, &knobs.min_p};
  const fb::Tid* tids[3] = {n.top_k(), n.top_p(), n.min_p()};
  for (int i = 0; i < 3; ++i) {
    if (tids[i] == nullptr) continue;
    const mx::array* knob = read(tids[i]);
    if (!knob) return false;
    if ((knob->size() != 1 && knob->size() != static_cast<size_t>(rows)) || knob->ndim() > 1) {
      return fail("row knob %d must be a scalar or have one value per row (%d)", i, rows);
    }
    *slots[i] = *knob;
  }
  if (knobs.top_k && !mx::issubdtype(knobs.top_k->dtype(), mx::integer)) return fail("top_k must be integer");
  const int cap = n.candidates();
  if (cap < 1) return fail("candidates must be >= 1, got %d", cap);
  const mx::array t = temperature_rows(*temperature, rows, program_.kernels == &kernels::cpu_kernels());
  return write(n.out(), program_.kernels->filter_threshold(*x, t, knobs, cap));
}

bool Interpreter::exec_gumbel_max(const fb::GumbelMaxNode& n) {
  const mx::array* scores = read(n.x());
  if (!scores) return false;
  const mx::array* temperature = read(n.temperature());
  if (!temperature) return false;
  if (scores->ndim() != 2 || scores->dtype() != mx::float32) return fail("x must be a [B, V] float32 tensor");
  const int rows = scores->shape(0), vocab = scores->shape(1);
  if (temperature->dtype() != mx::float32 || temperature->ndim() > 1 ||
      (temperature->ndim() == 1 && temperature->shape(0) != rows)) {
    return fail("temperature must be a float32 scalar or [%d]", rows);
  }
  std::optional<mx::array> seed;
  if (n.seed() != nullptr) {
    const mx::array* s = read(n.seed());
    if (!s) return false;
    if (!mx::issubdtype(s->dtype(), mx::integer) || s->ndim() > 1 || (s->ndim() == 1 && s->shape(0) != rows)) {
      return fail("seed must be an integer scalar or [%d]", rows);
    }
    seed = *s;
  }
  if (vocab == 0) return fail("x has an empty vocabulary");
  std::optional<mx::array> threshold;
  if (n.threshold() != nullptr) {
    const mx::array* thr = read(n.threshold());
    if (!thr) return false;
    if (thr->dtype() != mx::float32 || thr->size() != static_cast<size_t>(rows)) {
      return fail("threshold must be [%d, 1] float32", rows);
    }
    threshold = mx::reshape(*thr, {rows});
  }
  // Every row's temperature held by the host and none > 0: the pick is the argmax, so the device set builds
  // neither noise nor threshold (on an H200 a greedy step's sampler was ~60 of its ~420 graph nodes). Only
  // with a seed input: without one, the draw would also advance MLX's global key, which this must not skip.
  // The CPU set's one-pass kernel already skips what cannot win.
  if (seed && program_.kernels != &kernels::cpu_kernels() && kernels::known_none_positive(*temperature)) {
    return write(n.out(), bounded(kernels::greedy_pick(*scores), vocab));
  }
  const mx::array t = temperature_rows(*temperature, rows, program_.kernels == &kernels::cpu_kernels());
  return write(n.out(), bounded(program_.kernels->gumbel_max(*scores, t, seed, threshold), vocab));
}

bool Interpreter::exec_allowed_mask(const fb::AllowedMaskNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  const mx::array* mask = read(n.mask());
  if (!mask) return false;
  if (x->ndim() != 2 || x->dtype() != mx::float32) return fail("x must be a [B, V] float32 tensor");
  const int rows = x->shape(0), vocab = x->shape(1);
  if (vocab == 0) return fail("x has an empty vocabulary");
  const int words = (vocab + 31) / 32;
  if (mask->dtype() != mx::int32 || mask->ndim() != 2 || mask->shape(0) != rows || mask->shape(1) != words) {
    return fail("mask must be [%d, %d] int32 (one bit per token of V=%d)", rows, words, vocab);
  }
  return write(n.out(), program_.kernels->allowed_mask(*x, *mask));
}

bool Interpreter::exec_drawn_or_none(const fb::DrawnOrNoneNode& n) {
  const mx::array* tokens = read(n.tokens());
  if (!tokens) return false;
  const mx::array* x = read(n.x());
  if (!x) return false;
  if (x->ndim() != 2 || x->dtype() != mx::float32 || x->shape(1) == 0) return fail("x must be a [B, V] float32 tensor");
  if (tokens->ndim() != 1 || tokens->shape(0) != x->shape(0) || !mx::issubdtype(tokens->dtype(), mx::integer)) {
    return fail("tokens must be [%d] integer", x->shape(0));
  }
  return write(n.out(), program_.kernels->drawn_or_none(*tokens, *x));
}

}  // namespace etmlx
