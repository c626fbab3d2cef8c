"""RMSNorm, LayerNorm and rotary-embedding subgraphs become one fused node, and give what the composed
graph gives; near-misses stay composed and stay correct.

Tolerances: against eager PyTorch, helpers.TOL per dtype (kernel rounding; one or two ulps of the half
types). Against the same program exported with fuse=False: equal bit for bit for the rotary node (it
runs the graph's own ops) and within 1e-6 relative for the norms (MLX's mean and square where the
composed graph has its own reduction and pow).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from backends.mlx.exporter.export import export_to_pte
from backends.mlx.exporter.inspect_pte import TAG_NAMES, delegate_blobs
from backends.mlx.runtime.runner import load_method
from backends.mlx.serialization import serializer
from helpers import FLOATS, TOL, assert_matches

# Whole decoder exports: the slow tier (make test), not make test-fast.
pytestmark = pytest.mark.slow

FUSED = ("RmsNormNode", "LayerNormNode", "RopeNode")


def instructions(pte: bytes) -> list:
    return [ins for blob in delegate_blobs(pte) for ins in serializer.deserialize(blob).instructions or []]


def fused_counts(pte: bytes) -> Counter:
    counts = Counter(TAG_NAMES[ins.nodeType] for ins in instructions(pte))
    return Counter({k: counts[k] for k in FUSED if counts[k]})


def rope_nodes(pte: bytes) -> list:
    return [ins.node for ins in instructions(pte) if TAG_NAMES[ins.nodeType] == "RopeNode"]


def check(module, inputs, expect: Counter, fused_vs_plain_exact=False, **export_kw):
    """Export fused and unfused; the fused program has exactly `expect` fused nodes, the
    unfused none, and both match eager. Returns the fused program."""
    with torch.no_grad():
        expected = module(*inputs)
    fused = export_to_pte(module, tuple(inputs), **export_kw)
    plain = export_to_pte(module, tuple(inputs), fuse=False, **export_kw)
    assert fused.ops_outside == 0, fused.summary()
    assert fused_counts(fused.pte) == expect
    assert fused_counts(plain.pte) == Counter()
    got = load_method(fused.pte).execute(inputs)
    assert_matches(got, expected)
    ref = load_method(plain.pte).execute(inputs)
    for a, b in zip(got, ref):
        if fused_vs_plain_exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-6, atol=1e-6)
    return fused.pte


def rand(*shape, dtype=torch.float32):
    return (torch.randn(*shape) * 2).to(dtype)


# ---------------------------------------------------------------------------------------------
# RMSNorm


class LlamaRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm (also Qwen2's and Qwen3's q_norm / k_norm)."""

    def __init__(self, dim, dtype, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter((torch.rand(dim) + 0.5).to(dtype))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class TorchRMSNorm(nn.Module):
    def __init__(self, dim, dtype):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-5).to(dtype)
        with torch.no_grad():
            self.norm.weight.copy_(torch.rand(dim) + 0.5)

    def forward(self, x):
        return self.norm(x)


class CastBackNoWeight(nn.Module):
    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("spelling", ["llama", "torch_rms_norm", "cast_back_no_weight", "per_head"])
def test_rms_norm_is_one_node(spelling, dtype):
    torch.manual_seed(0)
    if spelling == "per_head":  # Qwen3's q_norm: [B, L, H, D] over D
        module, x = LlamaRMSNorm(8, dtype), rand(2, 5, 3, 8, dtype=dtype)
    else:
        module = {"llama": lambda: LlamaRMSNorm(16, dtype), "torch_rms_norm": lambda: TorchRMSNorm(16, dtype),
                  "cast_back_no_weight": CastBackNoWeight}[spelling]()
        x = rand(2, 7, 16, dtype=dtype)
    check(module, [x], Counter(RmsNormNode=1))


class NormOtherAxis(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)


class NormExtraUser(nn.Module):
    """The rsqrt is also an output: it must stay a value of its own."""

    def forward(self, x):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * r, r


class NormEpsInput(nn.Module):
    def forward(self, x, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class NormInHalf(nn.Module):
    """No upcast: the graph rounds every step to x's dtype; the kernel would not."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3)


class NormCubed(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(3).abs().mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("module,dtype", [(NormOtherAxis(), torch.float32), (NormExtraUser(), torch.float32),
                                          (NormEpsInput(), torch.float32), (NormInHalf(), torch.bfloat16),
                                          (NormInHalf(), torch.float16), (NormCubed(), torch.float32)],
                         ids=["other_axis", "extra_user", "eps_input", "bf16_core", "f16_core", "cubed"])
def test_rms_norm_near_miss_is_not_fused_and_still_correct(module, dtype):
    torch.manual_seed(0)
    inputs = [rand(2, 6, 16, dtype=dtype)]
    if isinstance(module, NormEpsInput):
        inputs.append(torch.tensor(1e-6))
    check(module, inputs, Counter())


class CastBackSharedByTwo(nn.Module):
    """The normalized value in x's dtype is used twice: fused up to it, the weight stays apart."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter((torch.rand(16) + 0.5).to(torch.bfloat16))

    def forward(self, x):
        h = x.float()
        y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return self.weight * y, y + 1


def test_rms_norm_partial_match_keeps_the_shared_value():
    torch.manual_seed(0)
    check(CastBackSharedByTwo(), [rand(3, 16, dtype=torch.bfloat16)], Counter(RmsNormNode=1))


# ---------------------------------------------------------------------------------------------
# LayerNorm


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_layer_norm_is_one_node(dtype, affine):
    torch.manual_seed(0)
    module = nn.LayerNorm(16, elementwise_affine=affine).to(dtype)
    if affine:
        with torch.no_grad():
            module.weight.copy_(torch.rand(16) * 2 + 0.5)
            module.bias.copy_(torch.randn(16))
    check(module, [rand(2, 5, 16, dtype=dtype) + 3], Counter(LayerNormNode=1))


class LayerNormStats(nn.Module):
    def forward(self, x, w, b):
        out, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], w, b, 1e-5)
        return out, mean, rstd


class LayerNormTwoAxes(nn.Module):
    def forward(self, x):
        return torch.nn.functional.layer_norm(x, x.shape[-2:], eps=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_norm_near_misses_stay_composed(dtype):
    torch.manual_seed(0)
    x = rand(2, 5, 16, dtype=dtype)
    check(LayerNormStats(), [x, rand(16, dtype=dtype), rand(16, dtype=dtype)], Counter())
    check(LayerNormTwoAxes(), [x], Counter())


# ---------------------------------------------------------------------------------------------
# Rotary embedding


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    """transformers' rotary embedding and apply_rotary_pos_emb over q [B, H, L, D] and k [B, Hkv, L, D].

    positions: "arange" (HF's cache_position), "shifted" (arange + 3), "per_row" (start_pos[b] + l,
    a batched decode step), "input" (an arbitrary position vector, as StaticCacheLM's input_pos).
    """

    def __init__(self, head_dim=8, positions="arange", scaling=1.0, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.positions, self.scaling = positions, scaling

    def tables(self, q, extra):
        batch, length = q.shape[0], q.shape[2]
        if self.positions == "per_row":
            pos = extra.unsqueeze(1) + torch.arange(length)
        elif self.positions == "input":
            pos = extra.unsqueeze(0).expand(batch, -1)
        else:
            pos = torch.arange(length).unsqueeze(0) + (3 if self.positions == "shifted" else 0)
        freqs = pos[:, :, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * self.scaling).to(q.dtype), (emb.sin() * self.scaling).to(q.dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def forward(self, q, k, extra):
        cos, sin = self.tables(q, extra)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rope_inputs(dtype, positions, batch=2, length=6):
    q, k = rand(batch, 4, length, 8, dtype=dtype), rand(batch, 2, length, 8, dtype=dtype)
    extra = {"per_row": torch.tensor([0, 11])[:batch], "input": torch.tensor([5, 2, 9, 0, 1, 7])[:length]}
    return [q, k, extra.get(positions, torch.zeros(batch, dtype=torch.int64))]


def _fast_rope_run(monkeypatch, pte, inputs):
    monkeypatch.setenv("ETMLX_FAST_ROPE", "1")
    try:
        return load_method(pte).execute(inputs)
    finally:
        monkeypatch.delenv("ETMLX_FAST_ROPE")


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("positions", ["arange", "shifted", "per_row"])
def test_rope_with_provable_positions_carries_the_kernel_operands(positions, dtype, monkeypatch):
    torch.manual_seed(0)
    module, inputs = Rotary(positions=positions), _rope_inputs(dtype, positions)
    pte = check(module, inputs, Counter(RopeNode=2), fused_vs_plain_exact=True)
    nodes = rope_nodes(pte)
    assert all(n.offset is not None and n.freqs is not None for n in nodes)
    # mlx::core::fast::rope from offset and freqs: on the CPU device MLX composes it from the same
    # float32 angles, so it must give the tables' result bit for bit.
    tables = load_method(pte).execute(inputs)
    kernel = _fast_rope_run(monkeypatch, pte, inputs)
    for a, b in zip(kernel, tables):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("case", ["input_positions", "scaled"])
def test_rope_without_a_proof_keeps_the_tables(case, dtype, monkeypatch):
    torch.manual_seed(0)
    positions = "input" if case == "input_positions" else "arange"
    module = Rotary(positions=positions, scaling=1.0 if case == "input_positions" else 0.5)
    inputs = _rope_inputs(dtype, positions)
    pte = check(module, inputs, Counter(RopeNode=2), fused_vs_plain_exact=True)
    assert all(n.offset is None and n.freqs is None for n in rope_nodes(pte))
    kernel = _fast_rope_run(monkeypatch, pte, inputs)  # nothing to switch to: same tables path
    assert_matches(kernel, module(*inputs))


@pytest.mark.parametrize("positions", ["per_row", "input"])
def test_rope_with_a_dynamic_length(positions, monkeypatch):
    torch.manual_seed(0)
    module = Rotary(positions=positions)
    inputs = _rope_inputs(torch.float32, positions, length=6)
    length = torch.export.Dim("length", min=2, max=32)
    extra_dims = {0: length} if positions == "input" else None
    result = export_to_pte(module, tuple(inputs), dynamic_shapes=({2: length}, {2: length}, extra_dims))
    assert result.ops_outside == 0, result.summary()
    nodes = rope_nodes(result.pte)
    assert len(nodes) == 2
    # start_pos[b] + arange(L) with a symbolic L is still provably consecutive; an input vector is not.
    assert all((n.offset is not None) == (positions == "per_row") for n in nodes)
    method = load_method(result.pte)
    for n in (2, 5, 13):
        q, k = rand(2, 4, n, 8), rand(2, 2, n, 8)
        extra = torch.tensor([3, 20]) if positions == "per_row" else torch.randperm(40)[:n]
        out = method.execute([q, k, extra])
        assert_matches(out, module(q, k, extra))
        for a, b in zip(_fast_rope_run(monkeypatch, result.pte, [q, k, extra]), out):
            assert torch.equal(a, b)


class RotateWrongHalves(nn.Module):
    def forward(self, x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., :half], x[..., half:]), -1) * sin


class RotateSharedRotation(nn.Module):
    def forward(self, x, cos, sin):
        rotated = _rotate_half(x)
        return x * cos + rotated * sin, rotated


class RotateTablesOtherDtype(nn.Module):
    def forward(self, x, cos, sin):
        return x * cos + _rotate_half(x) * sin  # float32 tables on bfloat16 x: promoted result


@pytest.mark.parametrize("module", [RotateWrongHalves(), RotateSharedRotation(), RotateTablesOtherDtype()],
                         ids=["wrong_halves", "shared_rotation", "tables_other_dtype"])
def test_rope_near_miss_is_not_fused_and_still_correct(module):
    torch.manual_seed(0)
    x_dtype = torch.bfloat16 if isinstance(module, RotateTablesOtherDtype) else torch.float32
    inputs = [rand(2, 3, 5, 8, dtype=x_dtype), rand(1, 1, 5, 8), rand(1, 1, 5, 8)]
    check(module, inputs, Counter())


def test_rope_with_operands_as_inputs_is_fused():
    torch.manual_seed(0)
    module = RotateTablesOtherDtype()  # same pattern with matching dtypes: tables of unknown origin
    check(module, [rand(2, 3, 5, 8), rand(1, 1, 5, 8), rand(1, 1, 5, 8)], Counter(RopeNode=1),
          fused_vs_plain_exact=True)


# ---------------------------------------------------------------------------------------------
# Runtime checks of the fused nodes' operands


def _mangled_run(module, inputs, edit, capfd, needle):
    import backends.mlx.exporter.preprocess as preprocess

    def mangle(graph):
        edit(graph)
        return serializer.serialize(graph)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(preprocess, "serialize", mangle)
        pte = export_to_pte(module, tuple(inputs)).pte
    method = load_method(pte)
    with pytest.raises(RuntimeError):
        method.execute(inputs)
    assert needle in capfd.readouterr().err


def _first(graph, kind):
    return next(ins.node for ins in graph.instructions if TAG_NAMES[ins.nodeType] == kind)


def test_runtime_refuses_a_weight_of_the_wrong_size(capfd):
    torch.manual_seed(0)
    module, x = LlamaRMSNorm(16, torch.float32), rand(2, 16)

    def edit(graph):
        node = _first(graph, "RmsNormNode")
        node.weight.idx = node.x.idx  # [2, 16] is not a 1-d weight

    _mangled_run(module, [x], edit, capfd, "weight must be 1-d")


def test_runtime_refuses_offset_without_freqs(capfd):
    torch.manual_seed(0)
    module = Rotary(positions="arange")

    def edit(graph):
        _first(graph, "RopeNode").freqs = None

    _mangled_run(module, _rope_inputs(torch.float32, "arange"), edit, capfd, "both offset and freqs")


def test_runtime_refuses_tables_that_do_not_fit(capfd):
    torch.manual_seed(0)

    def edit(graph):
        node = _first(graph, "RopeNode")
        node.cos.idx = node.offset.idx  # a 0-d integer is not a table

    _mangled_run(Rotary(positions="arange"), _rope_inputs(torch.float32, "arange"), edit, capfd, "cos and sin")


# ---------------------------------------------------------------------------------------------
# Whole models (transformers, random weights)

VOCAB = 96


class Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def _hf(family):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    if family == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=8))
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            bos_token_id=0, eos_token_id=1, attn_implementation="eager"))


# Two layers: Llama / Qwen2 have two RMSNorms per layer and a final one, q and k rotated per layer;
# Qwen3 adds q_norm and k_norm per layer; GPT-2 has two LayerNorms per layer and a final one.
MODEL_NODES = {
    "llama": Counter(RmsNormNode=5, RopeNode=4),
    "qwen2": Counter(RmsNormNode=5, RopeNode=4),
    "qwen3": Counter(RmsNormNode=9, RopeNode=4),
    "gpt2": Counter(LayerNormNode=5),
}


@pytest.mark.parametrize("family", list(MODEL_NODES))
def test_transformers_models_lower_to_fused_nodes(family, monkeypatch):
    torch.manual_seed(0)
    model = Logits(_hf(family).eval())
    ids = torch.randint(0, VOCAB, (2, 9))
    result = export_to_pte(model, (ids,))
    assert result.ops_outside == 0, result.summary()
    assert fused_counts(result.pte) == MODEL_NODES[family]
    # HF's cache_position arange: every rotary node may use the kernel.
    assert all(n.offset is not None and n.freqs is not None for n in rope_nodes(result.pte))
    with torch.no_grad():
        expected = model(ids)
    out = load_method(result.pte).execute([ids])[0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if MODEL_NODES[family]["RopeNode"]:
        assert torch.equal(_fast_rope_run(monkeypatch, result.pte, [ids])[0], out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_llama_matches_the_unfused_program(dtype):
    torch.manual_seed(0)
    model = Logits(_hf("llama").eval().to(dtype))
    ids = torch.randint(0, VOCAB, (1, 7))
    fused = export_to_pte(model, (ids,))
    plain = export_to_pte(model, (ids,), fuse=False)
    assert fused_counts(fused.pte) == MODEL_NODES["llama"]
    a = load_method(fused.pte).execute([ids])[0]
    b = load_method(plain.pte).execute([ids])[0]
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_static_cache_decoder_fuses_norms_and_rotary(family, monkeypatch):
    """The decoder's cache module (dynamic L, positions start_pos[b] + l): rotary nodes are proven."""
    from backends.mlx.llm.decoder.kv_cache import StaticCacheLM

    torch.manual_seed(0)
    model = _hf(family).eval()
    max_len = 16
    length = torch.export.Dim("length", min=1, max=max_len)
    example = (torch.ones(2, max_len, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
               torch.full((2,), max_len, dtype=torch.int64))
    result = export_to_pte(StaticCacheLM(model, max_seq_len=max_len, batch=2), example,
                           dynamic_shapes=({1: length}, None, None))
    assert result.ops_outside == 0, result.summary()
    assert fused_counts(result.pte) == MODEL_NODES[family]
    assert all(n.offset is not None and n.freqs is not None for n in rope_nodes(result.pte))
    a, b = torch.randint(0, VOCAB, (2, 9)).tolist()
    with torch.no_grad():
        full = model(input_ids=torch.tensor([a, b]), use_cache=False).logits
    calls = [(torch.tensor([a[:5], b[:5]]), [0, 0], [5, 3]),  # row b: 3 real tokens, padded
             (torch.tensor([a[5:7], b[3:5]]), [5, 3], [2, 2])]
    method = load_method(result.pte)
    for tokens, starts, lengths in calls:
        inputs = [tokens, torch.tensor(starts), torch.tensor(lengths)]
        out = method.execute(inputs)[0]
        expected = torch.stack([full[0, starts[0] + lengths[0] - 1], full[1, starts[1] + lengths[1] - 1]])
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if MODEL_NODES[family]["RopeNode"]:  # a fresh program: the kernel path from the same cache state
        monkeypatch.setenv("ETMLX_FAST_ROPE", "1")  # read at the load
        kernel = load_method(result.pte)
        replay = [kernel.execute([t, torch.tensor(s), torch.tensor(n)])[0] for t, s, n in calls]
        monkeypatch.delenv("ETMLX_FAST_ROPE")
        plain = load_method(result.pte)
        for (t, s, n), got in zip(calls, replay):
            assert torch.equal(got, plain.execute([t, torch.tensor(s), torch.tensor(n)])[0])
