// The fused-kernel nodes (SdpaNode, RmsNormNode, LayerNormNode, RopeNode): operands read and
// checked against the blob (mlx::core::fast trusts its caller's shapes on some devices), then
// the kernels in kernels/attention.h, norms.h and rope.h.
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include <mlx/ops.h>

#include "dtypes.h"
#include "interpreter.h"
#include "kernels/attention.h"
#include "kernels/attention_blocks.h"
#include "kernels/attention_cpu.h"
#include "kernels/attention_quantized_cpu.h"
#include "kernels/kernel_set.h"
#include "kernels/known_values.h"
#include "kernels/norms.h"
#include "kernels/rope.h"

namespace etmlx {

namespace mx = mlx::core;

namespace {

bool integer_vector(const mx::array& values) {
  return values.ndim() == 1 && values.size() > 0 && mx::issubdtype(values.dtype(), mx::integer);
}

// True when `t` broadcasts to `x` without changing x's shape.
bool broadcasts_to(const mx::array& t, const mx::array& x) {
  if (t.ndim() > x.ndim()) return false;
  const int lead = static_cast<int>(x.ndim() - t.ndim());
  for (int i = 0; i < static_cast<int>(t.ndim()); ++i) {
    if (t.shape(i) != 1 && t.shape(i) != x.shape(lead + i)) return false;
  }
  return true;
}

}  // namespace

// Keys [0, end) when the node's proven window leaves fewer than S of them, else S.
bool Interpreter::sdpa_window_end(const fb::SdpaNode& n, int batch, int query_len, int keys, int* end,
                                  bool* all_visible) {
  // (A causal node has L == S by definition; a window is only ever proven from a mask.)
  return key_window_end(n.window() && !n.causal(), n.window_base(), n.window_shift(), n.window_per_query(), batch,
                        query_len, keys, end, all_visible);
}

bool Interpreter::key_window_end(bool window, const fb::Tid* window_base, int64_t shift, bool per_query, int batch,
                                 int query_len, int keys, int* end, bool* all_visible) {
  *end = keys;
  *all_visible = false;
  if (!window) return true;
  const mx::array* base = nullptr;
  if (window_base != nullptr) {
    base = read(window_base);
    if (!base) return false;
    if (!integer_vector(*base)) return fail("window_base must be a non-empty 1-d integer tensor");
  }
  // One row only: with several, the window is the widest row's, and the number of
  // keys a row's products sum over (hence their rounding) would depend on which
  // other requests share the call. A served request must get the same bits
  // whatever it is batched with, so multi-row calls attend over every key.
  if (batch != 1) return true;
  // The rows' start positions are read only if the host already holds them (a program input);
  // computed in the graph, they stay unknown and every key is attended (nothing is evaluated
  // before the call's one evaluation).
  std::optional<int64_t> start = base ? kernels::known_max(*base) : std::optional<int64_t>(0);
  if (!start) return true;
  // The proof (fusion/key_window.py) is that mask[l, s] = s <= first + l (per query) or s <= first, with
  // first = start + shift: for a single query that is every key of [0, end), provided it sees a key
  // (first >= 0) and none was cut off past S.
  int64_t first = *start, e = 0;
  const int64_t extra = per_query ? query_len : 1;
  if (__builtin_add_overflow(first, shift, &first) || __builtin_add_overflow(first, extra, &e)) return true;
  if (e >= 1 && e < keys) *end = static_cast<int>(e);
  *all_visible = query_len == 1 && first >= 0 && e <= keys;
  return true;
}

bool Interpreter::sdpa_with_view(const fb::SdpaNode& n, const mx::array& q, const mx::array& k, const mx::array& v,
                                 const std::optional<mx::array>& mask, int end) {
  const auto* instrs = program_.graph->instructions();
  auto at = [&](size_t i) { return i < instrs->size() ? instrs->Get(i) : nullptr; };
  const fb::TransposeNode* t = at(pc_ + 1) ? at(pc_ + 1)->node_as_TransposeNode() : nullptr;
  if (!t || !t->x() || !t->out() || t->x()->idx() != n.out()->idx()) return false;
  // The reshape reads the transpose's result, or a CopyNode's alias of it (`.contiguous()`: exec_copy
  // writes the same array, so the id check below holds through it).
  size_t reshape_at = pc_ + 2;
  uint32_t reshaped = t->out()->idx();
  if (const fb::CopyNode* c = at(reshape_at) ? at(reshape_at)->node_as_CopyNode() : nullptr;
      c && c->x() && c->out() && c->x()->idx() == reshaped) {
    reshaped = c->out()->idx();
    ++reshape_at;
  }
  const fb::ReshapeNode* r = at(reshape_at) ? at(reshape_at)->node_as_ReshapeNode() : nullptr;
  if (!r || !r->x() || r->x()->idx() != reshaped) return false;
  const mx::Shape result{q.shape(0), q.shape(1), q.shape(2), v.shape(3)};
  std::vector<int> perm;
  if (!quiet_perm(*t, 4, &perm)) return false;
  mx::Shape transposed, shape;
  for (int p : perm) transposed.push_back(result[p]);
  std::vector<std::pair<int64_t, int64_t>> values;
  if (!quiet_shape(*r, transposed, &shape, &values)) return false;
  std::vector<mx::array> outs = kernels::sdpa_decode_viewed_cpu(q, k, v, n.scale(), n.causal(), mask, end, perm, shape);
  if (outs.size() != 3) return false;
  stash(pc_ + 1, outs[1], {{t->x()->idx(), outs[0].id()}});
  stash(reshape_at, outs[2], {{r->x()->idx(), outs[1].id()}}, std::move(values));
  return write(n.out(), std::move(outs[0]));
}

// An attention node's optional mask: at most 4-d; an additive mask is cast to the query dtype, a boolean one
// stays boolean. False (after fail()) for a bad mask; an absent mask leaves *out empty.
bool Interpreter::read_attention_mask(const fb::Tid* id, mx::Dtype dtype, std::optional<mx::array>* out) {
  if (id == nullptr) return true;
  const mx::array* m = read(id);
  if (!m) return false;
  if (m->ndim() > 4) return fail("mask has %d dims (at most 4)", static_cast<int>(m->ndim()));
  *out = m->dtype() == mx::bool_ ? *m : mx::astype(*m, dtype);
  return true;
}

// The fewest query rows sdpa_cpu runs as a prefill (two matmuls around its softmax); fewer take its decode loop,
// whose sums round differently, so a query block never has fewer.
constexpr int kCpuPrefillRows = 16;

bool Interpreter::exec_sdpa(const fb::SdpaNode& n) {
  const mx::array* q = read(n.q());
  if (!q) return false;
  const mx::array* k = read(n.k());
  if (!k) return false;
  const mx::array* v = read(n.v());
  if (!v) return false;
  if (q->ndim() != 4 || k->ndim() != 4 || v->ndim() != 4) return fail("q, k and v must be 4-d");
  if (!mx::issubdtype(q->dtype(), mx::floating) || k->dtype() != q->dtype() || v->dtype() != q->dtype()) {
    return fail("q, k and v must share one floating dtype");
  }
  const int heads = q->shape(1), kv_heads = k->shape(1);
  if (kv_heads == 0 || heads % kv_heads != 0 || v->shape(1) != kv_heads) {
    return fail("has %d query heads for %d key/value heads", heads, kv_heads);
  }
  if (k->shape(3) != q->shape(3) || k->shape(2) != v->shape(2) || k->shape(0) != q->shape(0) ||
      v->shape(0) != q->shape(0)) {
    return fail("q, k and v shapes do not fit together");
  }
  std::optional<mx::array> mask;
  if (!read_attention_mask(n.mask(), q->dtype(), &mask)) return false;
  if (n.causal() && q->shape(2) != k->shape(2)) return fail("causal attention needs L == S");
  const int keys = k->shape(2);
  int end = keys;
  bool all_visible = false;
  if (!sdpa_window_end(n, q->shape(0), q->shape(2), keys, &end, &all_visible)) return false;
  if (program_.kernels == &kernels::cpu_kernels()) {  // its own softmax (attention_cpu.h)
    if (program_.fuse_nodes && sdpa_with_view(n, *q, *k, *v, mask, end)) return true;
    if (n.causal()) return write(n.out(), kernels::sdpa_cpu(*q, *k, *v, n.scale(), true, mask, end));
    // A long prefill's scores a block of query rows at a time (attention_blocks.h).
    return write(n.out(), kernels::attend_in_query_blocks(
                              *q, mask, end, kCpuPrefillRows,
                              [&](const mx::array& qb, const std::optional<mx::array>& mb) {
                                return kernels::sdpa_cpu(qb, *k, *v, n.scale(), false, mb, end);
                              }));
  }
  // A decode step without its array mask runs MLX's fused decode kernel on CUDA instead of matmul, where
  // and softmax composed (~10 graph nodes per layer, which a host-bound GPU step pays for: an H200's decode
  // step went from 565 to 417 nodes). Several queries keep the mask: MLX's causal mode would send them to
  // cuDNN, whose plan per key count made an H200's 9-query verify calls slower (3.4-3.9 -> 4.7-4.8 ms).
  if (all_visible) return write(n.out(), kernels::sdpa(*q, *k, *v, n.scale(), false, std::nullopt, end));
  return write(n.out(), kernels::sdpa(*q, *k, *v, n.scale(), n.causal(), mask, end));
}

// Few query rows (a decode step) multiply the packed cache directly (mx::quantized_matmul, as mlx-lm's
// quantized attention; on the CPU set one host loop, attention_quantized_cpu.h); more (a prefill) dequantize
// the keys they attend to and run the float attention, whose products go to BLAS: MLX's CPU quantized matmul
// is a plain loop, far slower at a prefill's sizes.
constexpr int kQuantizedAttentionRows = 16;

bool Interpreter::exec_quantized_sdpa(const fb::QuantizedSdpaNode& n) {
  const mx::array* q = read(n.q());
  if (!q) return false;
  const mx::array* packed[2] = {read(n.k()), nullptr};
  if (!packed[0]) return false;
  const mx::array* ks = read(n.k_scales());
  if (!ks) return false;
  const mx::array* kb = read(n.k_biases());
  if (!kb) return false;
  packed[1] = read(n.v());
  if (!packed[1]) return false;
  const mx::array* vs = read(n.v_scales());
  if (!vs) return false;
  const mx::array* vb = read(n.v_biases());
  if (!vb) return false;
  const int bits = n.bits(), group = n.group_size();
  if (bits != 4 && bits != 8) return fail("bits must be 4 or 8, got %d", bits);
  if (group != 32 && group != 64 && group != 128) return fail("group_size must be 32, 64 or 128, got %d", group);
  if (q->ndim() != 4 || !mx::issubdtype(q->dtype(), mx::floating)) return fail("q must be 4-d floating");
  const int batch = q->shape(0), heads = q->shape(1), dim = q->shape(3);
  const mx::array* parts[6] = {packed[0], ks, kb, packed[1], vs, vb};
  // The scales and biases: q's dtype, or (--kv-scale-dtype, a float32 program's default) a narrower float.
  const mx::Dtype scale_dtype = ks->dtype();
  if (scale_dtype != mx::float32 && scale_dtype != mx::bfloat16 && scale_dtype != mx::float16) {
    return fail("the cache's scales are %s, not float32, bfloat16 or float16", mlx_dtype_name(scale_dtype));
  }
  const int kv_heads = packed[0]->shape(1), keys = packed[0]->ndim() == 4 ? packed[0]->shape(2) : -1;
  if (dim % group != 0) return fail("head size %d is not a multiple of group_size %d", dim, group);
  for (int i = 0; i < 6; ++i) {
    const mx::array& a = *parts[i];
    const bool words = i % 3 == 0;
    const int last = words ? dim * bits / 8 : dim / group;
    if (a.ndim() != 4 || a.shape(0) != batch || a.shape(1) != kv_heads || a.shape(2) != keys || a.shape(3) != last) {
      return fail("cache operand %d must be [%d, %d, %d, %d]", i, batch, kv_heads, keys, last);
    }
    if (words ? a.dtype() != mx::uint8 : a.dtype() != scale_dtype) {
      return fail("cache operand %d is %s: the packed cache is uint8, its scales and biases all one float dtype", i,
                  mlx_dtype_name(a.dtype()));
    }
  }
  if (kv_heads == 0 || heads % kv_heads != 0) return fail("has %d query heads for %d key/value heads", heads, kv_heads);
  std::optional<mx::array> mask;
  if (!read_attention_mask(n.mask(), q->dtype(), &mask)) return false;
  const int query_len = q->shape(2);
  int end = keys;
  bool all_visible = false;
  if (!key_window_end(n.window(), n.window_base(), n.window_shift(), n.window_per_query(), batch, query_len, keys,
                      &end, &all_visible)) {
    return false;
  }
  // The mask over all S keys cut to the keys [0, end).
  if (mask && end < keys && mask->ndim() >= 1 && mask->shape(-1) == keys) {
    mx::Shape stop = mask->shape();
    stop.back() = end;
    mask = mx::slice(*mask, mx::Shape(mask->ndim(), 0), stop);
  }
  if (all_visible) mask = std::nullopt;
  const bool cpu_set = program_.kernels == &kernels::cpu_kernels();
  if (query_len * (heads / kv_heads) <= kQuantizedAttentionRows && cpu_set) {
    // A decode step on the CPU set: one host loop over the packed cache (attention_quantized_cpu.h).
    std::vector<mx::array> whole;
    for (const mx::array* a : parts) whole.push_back(*a);
    if (auto out = kernels::sdpa_quantized_decode_cpu(*q, whole, n.scale(), mask, end, group, bits)) {
      return write(n.out(), *out);
    }
  }
  // The keys [0, end) of every cache operand; the packed bytes as MLX's words.
  std::vector<mx::array> cache;
  for (int i = 0; i < 6; ++i) {
    mx::array a = *parts[i];
    if (end < keys) a = mx::slice(a, {0, 0, 0, 0}, {batch, kv_heads, end, a.shape(3)});
    if (i % 3 == 0) a = mx::view(mx::contiguous(a), mx::uint32);
    cache.push_back(std::move(a));
  }
  if (query_len * (heads / kv_heads) > kQuantizedAttentionRows) {
    // Narrower scales widened to q's dtype: mx::dequantize would otherwise round the keys to the scales' dtype.
    // (mx::quantized_matmul below takes them as they are and computes in q's dtype.)
    for (int i = 0; i < 6; ++i) {
      if (i % 3 != 0 && cache[i].dtype() != q->dtype()) cache[i] = mx::astype(cache[i], q->dtype());
    }
    if (cpu_set) {
      // A long prefill chunk over a long cache: one key/value head's keys and values dequantized at a time when
      // all of them would take more than the score limit (float32 at 32k positions of 8 heads of 128: 256 MiB),
      // and the scores a block of query rows at a time (attention_blocks.h).
      const auto attend = [&](const mx::array& qh, const std::optional<mx::array>& mh, const mx::array* words) {
        mx::array k = mx::dequantize(words[0], words[1], words[2], group, bits);
        mx::array v = mx::dequantize(words[3], words[4], words[5], group, bits);
        return kernels::attend_in_query_blocks(qh, mh, end, kCpuPrefillRows,
                                               [&](const mx::array& qb, const std::optional<mx::array>& mb) {
                                                 return kernels::sdpa_cpu(qb, k, v, n.scale(), false, mb, end);
                                               });
      };
      return write(n.out(), kernels::attend_per_kv_head(*q, mask, cache, dim, attend));
    }
    mx::array k = mx::dequantize(cache[0], cache[1], cache[2], group, bits);
    mx::array v = mx::dequantize(cache[3], cache[4], cache[5], group, bits);
    return write(n.out(), kernels::sdpa(*q, k, v, n.scale(), false, mask, end));
  }
  // Query heads grouped under their key/value head as rows of one product: [B, Hkv, R * L, D] against the cache
  // [B, Hkv, S, .] (a broadcast cache axis would have MLX copy the cache once per query head).
  const int repeats = heads / kv_heads;
  mx::array grouped = mx::reshape(mx::multiply(*q, mx::array(n.scale(), q->dtype())),
                                  {batch, kv_heads, repeats * query_len, dim});
  mx::array scores = mx::quantized_matmul(grouped, cache[0], cache[1], cache[2], true, group, bits);
  if (mask) {
    mx::array m = *mask;
    while (m.ndim() < 4) m = mx::expand_dims(m, 0);
    if (m.shape(1) != 1 && m.shape(1) != heads) {
      return fail("mask's head axis is %d, neither 1 nor the %d query heads", m.shape(1), heads);
    }
    const int rows = m.shape(0), span = m.shape(3);
    m = m.shape(1) == 1 ? mx::expand_dims(m, 1) : mx::reshape(m, {rows, kv_heads, repeats, m.shape(2), span});
    m = mx::broadcast_to(m, {rows, kv_heads, repeats, query_len, span});
    m = mx::reshape(m, {rows, kv_heads, repeats * query_len, span});
    scores = m.dtype() == mx::bool_
                 ? mx::where(m, scores, mx::array(-std::numeric_limits<float>::infinity(), scores.dtype()))
                 : mx::add(scores, m);
  }
  mx::array weights = mx::softmax(scores, std::vector<int>{-1}, true);
  mx::array out = mx::quantized_matmul(weights, cache[3], cache[4], cache[5], false, group, bits);
  return write(n.out(), mx::reshape(out, {batch, heads, query_len, dim}));
}

bool Interpreter::norm_operand(const fb::Tid* t, const mx::array& x, const char* what,
                               std::optional<mx::array>* out) {
  if (t == nullptr) return true;  // optional operand left out
  const mx::array* a = read(t);
  if (!a) return false;
  if (!mx::issubdtype(a->dtype(), mx::floating)) {
    return fail("%s must be floating, got %s", what, mlx_dtype_name(a->dtype()));
  }
  if (a->ndim() != 1 || a->shape(0) != x.shape(-1)) {
    return fail("%s must be 1-d with %d elements (x's last size)", what, static_cast<int>(x.shape(-1)));
  }
  *out = *a;
  return true;
}

bool Interpreter::norm_input(const fb::Tid* t, const mx::array** x) {
  *x = read(t);
  if (!*x) return false;
  if ((*x)->ndim() == 0) return fail("needs x with at least one dimension");
  if (!mx::issubdtype((*x)->dtype(), mx::floating)) {
    return fail("needs a floating x, got %s", mlx_dtype_name((*x)->dtype()));
  }
  return true;
}

bool Interpreter::add_then_rms_norm(const fb::BinaryNode& add, const mx::array& a, const mx::array& b) {
  if (program_.kernels != &kernels::cpu_kernels()) return false;
  const size_t at = static_cast<size_t>(program_.norm_after_add[pc_]);
  const fb::RmsNormNode* norm = program_.graph->instructions()->Get(at)->node_as_RmsNormNode();
  std::optional<mx::array> weight;
  std::vector<std::pair<uint32_t, std::uintptr_t>> operands;
  if (norm->weight() != nullptr) {
    const mx::array* w = peek(norm->weight());
    if (w == nullptr) return false;  // the norm reports it at its turn
    weight = *w;
    operands.push_back({norm->weight()->idx(), w->id()});
  }
  // Checks as exec_rms_norm's (a float32 weight of x's last size), else the norm runs on its own.
  std::vector<mx::array> outs = kernels::add_rms_norm_cpu(a, b, weight, norm->eps());
  if (outs.size() != 2) return false;
  operands.push_back({add.out()->idx(), outs[0].id()});
  stash(at, outs[1], std::move(operands));
  return write(add.out(), std::move(outs[0]));
}

bool Interpreter::exec_rms_norm(const fb::RmsNormNode& n) {
  if (take_stashed(n.out())) return true;  // made with the residual add before it
  const mx::array* x = nullptr;
  if (!norm_input(n.x(), &x)) return false;
  std::optional<mx::array> weight;
  if (!norm_operand(n.weight(), *x, "weight", &weight)) return false;
  return write(n.out(), program_.kernels->rms_norm(*x, weight, n.eps()));
}

bool Interpreter::exec_layer_norm(const fb::LayerNormNode& n) {
  const mx::array* x = nullptr;
  if (!norm_input(n.x(), &x)) return false;
  std::optional<mx::array> weight, bias;
  if (!norm_operand(n.weight(), *x, "weight", &weight)) return false;
  if (!norm_operand(n.bias(), *x, "bias", &bias)) return false;
  return write(n.out(), kernels::layer_norm(*x, weight, bias, n.eps()));
}

bool Interpreter::rope_pair(const fb::RopeNode& n, const mx::array& x, const mx::array& cos, const mx::array& sin) {
  if (program_.kernels != &kernels::cpu_kernels() || pc_ >= program_.rope_partner.size() ||
      program_.rope_partner[pc_] < 0) {
    return false;
  }
  const size_t at = static_cast<size_t>(program_.rope_partner[pc_]);
  const fb::RopeNode* k = program_.graph->instructions()->Get(at)->node_as_RopeNode();
  const mx::array* kx = peek(k->x());
  if (kx == nullptr) return false;  // not made yet: each runs on its own
  // k's tables in other slots are casts of q's (linear_groups.cpp), one array only when shared_view keeps it.
  if ((k->cos()->idx() != n.cos()->idx() || k->sin()->idx() != n.sin()->idx()) &&
      std::max(cos.size(), sin.size()) > kMaxShared) {
    return false;
  }
  // The partner's own checks (exec_rope's, for tables in x's dtype): else it runs, and reports, on its own.
  if (kx->dtype() != x.dtype() || kx->ndim() == 0 || kx->shape(-1) != x.shape(-1) || !broadcasts_to(cos, *kx) ||
      !broadcasts_to(sin, *kx)) {
    return false;
  }
  std::vector<mx::array> outs = kernels::rope_tables_pair_cpu(x, *kx, cos, sin);
  if (outs.size() != 2) return false;
  stash(at, outs[1], {{k->x()->idx(), kx->id()}, {k->cos()->idx(), cos.id()}, {k->sin()->idx(), sin.id()}});
  return write(n.out(), std::move(outs[0]));
}

bool Interpreter::exec_rope(const fb::RopeNode& n) {
  if (take_stashed(n.out())) return true;  // made with the RoPE before it (the layer's q)
  const mx::array* x = read(n.x());
  if (!x) return false;
  const mx::array* cos = read(n.cos());
  if (!cos) return false;
  const mx::array* sin = read(n.sin());
  if (!sin) return false;
  if (!mx::issubdtype(x->dtype(), mx::floating)) {
    return fail("needs a floating x, got %s", mlx_dtype_name(x->dtype()));
  }
  if (x->ndim() == 0 || x->shape(-1) % 2 != 0 || x->shape(-1) == 0) {
    return fail("needs x whose last size is even and positive");
  }
  const int dims = x->shape(-1), half = dims / 2;
  for (const mx::array* t : {cos, sin}) {
    if (t->dtype() != x->dtype()) {
      return fail("needs cos and sin in x's dtype %s, got %s", mlx_dtype_name(x->dtype()),
                  mlx_dtype_name(t->dtype()));
    }
    if (t->ndim() == 0 || t->shape(-1) != dims || !broadcasts_to(*t, *x)) {
      return fail("needs cos and sin broadcastable to x with last size %d", dims);
    }
  }
  if ((n.offset() == nullptr) != (n.freqs() == nullptr)) return fail("needs both offset and freqs, or neither");
  if (n.offset() != nullptr) {
    const mx::array* offset = read(n.offset());
    if (!offset) return false;
    const mx::array* freqs = read(n.freqs());
    if (!freqs) return false;
    if (x->ndim() != 4) return fail("with offset needs x [B, H, L, D]");
    if (!mx::issubdtype(offset->dtype(), mx::integer) || offset->ndim() > 1 ||
        (offset->ndim() == 1 && offset->size() != 1 && offset->shape(0) != x->shape(0))) {
      return fail("needs an integer offset, 0-d or one per batch row");
    }
    if (freqs->dtype() != mx::float32 || freqs->ndim() != 1 || freqs->shape(0) != half) {
      return fail("needs float32 freqs of %d elements", half);
    }
    if (kernels::use_fast_rope(program_.kernels->fast_rope, program_.options.fast_rope)) {
      // mx::fast::rope casts a 64-bit offset to int32 itself, once per call of it: every layer's q and k
      // would each add that cast to the graph (a GPU kernel each). The cast is made once per call here.
      const mx::array off = offset->dtype().size() == 4 ? *offset
          : shared_view(4, *offset, {}, [](const mx::array& a, const std::vector<int>&) {
              return mx::astype(a, mx::int32);
            });
      return write(n.out(), kernels::rope_fast(*x, off, *freqs));
    }
  }
  if (program_.fuse_nodes && rope_pair(n, *x, *cos, *sin)) return true;
  return write(n.out(), program_.kernels->rope_from_tables(*x, *cos, *sin));
}

}  // namespace etmlx
