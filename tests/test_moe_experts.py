"""MoE expert matmuls: mlx::gather_mm / gather_qmm (GatherMmNode / GatherQmmNode) against their host reference
and MLX's own kernels, over layouts, dtypes and a dynamic token count through real .pte files; bad operands are
refused at export; an exported MoE decoder multiplies its experts by index, never through a gathered copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T

import backends.mlx  # noqa: F401  (before mlx.core: routes MLX's CPU GEMMs)
import mlx.core as mx
from backends.mlx.cli.main import main
from backends.mlx.exporter.export import export_to_pte
from backends.mlx.exporter.inspect_pte import delegate_blobs
from backends.mlx.llm.quantize.affine import quantize_tensor
from backends.mlx.runtime.runner import run
from backends.mlx.serialization.generated.node_table import NODE_TAGS
from backends.mlx.serialization.serializer import deserialize
from helpers import TOL

EXPERTS = 6
# Token counts per call: T * K below and above the expert count (the CPU widening of half precision takes a
# different path on each side), one token, and the example's own count.
TOKEN_COUNTS = (5, 1, 2, 17)


class _GatherMm(torch.nn.Module):
    def __init__(self, w, transposed):
        super().__init__()
        self.register_buffer("w", w)
        self.transposed = transposed

    def forward(self, x, indices):
        return torch.ops.mlx.gather_mm(x, self.w, indices, self.transposed)


class _GatherQmm(torch.nn.Module):
    def __init__(self, w, scales, biases, group, bits):
        super().__init__()
        self.register_buffer("w", w)
        self.register_buffer("scales", scales)
        self.register_buffer("biases", biases)
        self.group, self.bits = group, bits

    def forward(self, x, indices):
        return torch.ops.mlx.gather_qmm(x, self.w, self.scales, self.biases, indices, self.group, self.bits)


def _inputs(tokens, k, in_features, per_pair, dtype, generator):
    shape = (tokens, k, in_features) if per_pair else (tokens, in_features)
    x = torch.randn(shape, generator=generator).to(dtype)
    return x, torch.randint(0, EXPERTS, (tokens, k), generator=generator)


def _export_dynamic(module, x, indices):
    tokens = torch.export.Dim("tokens", min=1, max=64)
    return export_to_pte(module, (x, indices), dynamic_shapes=({0: tokens}, {0: tokens}))


def _independent(x, w, indices, transposed):
    """The definition, by a gather of every pair's matrix (what the delegate must not build, fine here)."""
    rows = x.float().unsqueeze(1).expand(*indices.shape, x.shape[-1]) if x.dim() == 2 else x.float()
    mats = w.float()[indices]  # [T, K, out, in] or [T, K, in, out]
    eq = "tki,tkio->tko" if transposed else "tki,tkoi->tko"
    return torch.einsum(eq, rows, mats)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("per_pair", [False, True])
def test_gather_mm_matches_reference_for_every_token_count(dtype, transposed, per_pair):
    g = torch.Generator().manual_seed(1 + 2 * transposed + per_pair)
    in_features, out_features, k = 32, 48, 2
    shape = (EXPERTS, in_features, out_features) if transposed else (EXPERTS, out_features, in_features)
    module = _GatherMm(torch.randn(shape, generator=g).to(dtype), transposed)
    result = _export_dynamic(module, *_inputs(5, k, in_features, per_pair, dtype, g))
    assert result.ops_outside == 0
    for tokens in TOKEN_COUNTS:
        x, indices = _inputs(tokens, k, in_features, per_pair, dtype, g)
        expected = module(x, indices)
        # The host reference is the definition (float32: to rounding; bf16: it rounds the same product once).
        torch.testing.assert_close(expected.float(), _independent(x, module.w, indices, transposed),
                                   **TOL[dtype])
        (got,) = run(result.pte, [x, indices])
        assert got.dtype == dtype and tuple(got.shape) == (tokens, k, out_features)
        torch.testing.assert_close(got, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (4, 128)])
def test_gather_qmm_matches_mlx_kernel_and_reference(dtype, bits, group):
    g = torch.Generator().manual_seed(bits + group)
    in_features, out_features, k = 128, 40, 2
    w, scales, biases = quantize_tensor((torch.randn(EXPERTS, out_features, in_features, generator=g) * 0.3)
                                        .to(dtype), group, bits)
    module = _GatherQmm(w, scales, biases, group, bits)
    result = _export_dynamic(module, *_inputs(5, k, in_features, False, dtype, g))
    assert result.ops_outside == 0
    to_mx = lambda t: mx.array(t.float().numpy()).astype(mx.bfloat16) if t.dtype == torch.bfloat16 else mx.array(
        t.numpy())
    for tokens in TOKEN_COUNTS:
        x, indices = _inputs(tokens, k, in_features, False, dtype, g)
        (got,) = run(result.pte, [x, indices])
        assert got.dtype == dtype and tuple(got.shape) == (tokens, k, out_features)
        mlx_out = mx.gather_qmm(to_mx(x).reshape(tokens, 1, 1, in_features), to_mx(w), to_mx(scales),
                                to_mx(biases), rhs_indices=to_mx(indices), transpose=True, group_size=group,
                                bits=bits)
        np.testing.assert_array_equal(got.float().numpy(),
                                      np.array(mlx_out.astype(mx.float32)).reshape(tokens, k, out_features))
        expected = module(x, indices)
        # bfloat16: MLX dequantizes and accumulates in bfloat16, the reference rounds once from float32 (as
        # test_quantized.py's QuantizedLinear check): within 5% of the range there.
        scale = expected.float().abs().max().item()
        tol = dict(rtol=0, atol=0.05 * scale) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.float(), expected.float(), **tol)


def test_gather_mm_refuses_mismatched_operands_at_export():
    w = torch.randn(EXPERTS, 8, 16)
    with pytest.raises(ValueError, match="x is torch.bfloat16 but the experts compute in torch.float32"):
        export_to_pte(_GatherMm(w, False), (torch.randn(3, 16).bfloat16(), torch.zeros(3, 2, dtype=torch.long)))
    with pytest.raises(ValueError, match="last size 8 is not the experts' 16 inputs"):
        export_to_pte(_GatherMm(w, False), (torch.randn(3, 8), torch.zeros(3, 2, dtype=torch.long)))
    with pytest.raises(ValueError, match="indices must be an integer"):
        export_to_pte(_GatherMm(w, False), (torch.randn(3, 16), torch.zeros(3, 2)))


# --- an exported MoE decoder ------------------------------------------------------------------------------

MOE_CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
TAG_NAMES = {v: k for k, v in NODE_TAGS.items()}


def _slots(node) -> set[int]:
    """Every tensor slot a node names (inputs and output)."""
    found = set()
    for value in vars(node).values():
        for item in value if isinstance(value, list) else [value]:
            if hasattr(item, "idx") and type(item).__name__.startswith("Tid"):
                found.add(item.idx)
    return found


@pytest.mark.slow  # MoE decoder exports
@pytest.mark.parametrize("flags,node", [((), "GatherMmNode"), (("--quantize", "int8", "--group-size", "32"),
                                                                "GatherQmmNode")])
def test_moe_program_multiplies_experts_by_index(tmp_path, flags, node):
    torch.manual_seed(3)
    T.AutoModelForCausalLM.from_config(T.Qwen3MoeConfig(**MOE_CONFIG, head_dim=16)).save_pretrained(tmp_path / "m")
    pte = tmp_path / "m.pte"
    assert main(["export", "--model", str(tmp_path / "m"), "--out", str(pte), "--max-seq-len", "32", *flags]) == 0
    (blob,) = delegate_blobs(pte.read_bytes())
    graph = deserialize(blob)
    kinds = [TAG_NAMES[i.nodeType] for i in graph.instructions]
    # Two projections (gate_up, down) per layer.
    assert kinds.count(node) == 2 * MOE_CONFIG["num_hidden_layers"], kinds
    stacks = {c.slot.idx for c in graph.constants if len(c.shape) == 3 and c.shape[0] == MOE_CONFIG["num_experts"]}
    assert len(stacks) == (6 if flags else 2) * MOE_CONFIG["num_hidden_layers"]
    readers = {TAG_NAMES[i.nodeType] for i in graph.instructions if _slots(i.node) & stacks}
    assert readers == {node}, f"expert stacks read by {readers}: a gathered copy of the weights"


@pytest.mark.slow  # an int8 MoE decoder export
def test_int8_moe_program_decodes_as_the_eager_quantized_model(tmp_path):
    """The quantized experts run as the host reference does: each greedy token of the int8 program is the
    eager int8 model's (etmlx experts, quantized by the same quantize_model) best token in that context."""
    from backends.mlx.llm.decoder.loop import Decoder
    from backends.mlx.llm.quantize.affine import quantize_model

    torch.manual_seed(7)
    config = T.Qwen2MoeConfig(**MOE_CONFIG, shared_expert_intermediate_size=32)
    T.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    pte = tmp_path / "q.pte"
    assert main(["export", "--model", str(tmp_path / "m"), "--out", str(pte), "--max-seq-len", "32",
                 "--quantize", "int8", "--group-size", "32"]) == 0
    prompt = [5, 17, 99, 3, 42, 7]
    tokens = Decoder(pte).generate(prompt, 10).tokens
    model = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), experts_implementation="etmlx").eval()
    quantize_model(model, 8, 32)
    assert any(type(m).__name__ == "QuantizedExperts" for m in model.modules())
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    assert logits.argmax(-1).tolist() == tokens
