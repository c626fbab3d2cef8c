"""A bf16-scale quantized embedding under float32 activations dequantizes in float32: teacher-forced logits of
an `mlx_lm.convert -q` directory of a bf16 checkpoint equal mlx-lm's float32 model's (every float, scales too,
in float32) within float32 noise, in the eager model and in the program; rounding the looked-up rows to bf16,
as MLX's dequantize in the scales' dtype does, misses by far more."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import backends.mlx  # noqa: F401  (before mlx.core: routes MLX's CPU GEMMs)
import mlx.core as mx
from benchmarks.checkpoints import save_tokenizer

# ~1e-6 of the logits' scale is float32 rounding through two layers; a bf16-rounded embedding gives ~1e-2.
TOLERANCE = 2e-5
TOKENS = np.random.default_rng(0).integers(0, 256, (1, 48))


def _bf16_quantized(tmp_path, tied: bool) -> Path:
    """A wide-init random bf16 Llama converted by mlx_lm.convert -q, which keeps its bf16 scales and biases."""
    from mlx_lm import convert
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.1, tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(3)
    source = tmp_path / "bf16"
    LlamaForCausalLM(config).eval().to(torch.bfloat16).save_pretrained(source)
    saved = json.loads((source / "config.json").read_text())
    saved["rope_theta"] = saved["rope_parameters"]["rope_theta"]  # where mlx-lm reads it
    (source / "config.json").write_text(json.dumps(saved))
    save_tokenizer(config.vocab_size, source)
    out = tmp_path / "q4"
    convert(str(source), str(out), quantize=True, q_group_size=64, q_bits=4, dtype=None)
    return out


def _mlx_lm_logits(directory, all_float32: bool) -> np.ndarray:
    """mlx-lm's teacher-forced logits: every float in float32 (the reference), or, as a control, all but the
    quantized layers' scales and biases (its embedding then dequantizes to bf16 rows)."""
    from mlx.utils import tree_map_with_path
    from mlx_lm import load

    model, _ = load(str(directory))
    if all_float32:
        model.set_dtype(mx.float32)
    else:
        keep = lambda path, x: path.endswith(("scales", "biases")) or not mx.issubdtype(x.dtype, mx.floating)
        model.update(tree_map_with_path(lambda path, x: x if keep(path, x) else x.astype(mx.float32),
                                        model.parameters()))
    return np.array(model(mx.array(TOKENS))[0].astype(mx.float32))


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def _gap(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_bf16_scale_embedding_matches_mlx_lm_float32(tmp_path, tied):
    from backends.mlx.exporter.export import export_to_pte
    from backends.mlx.llm.quantize.mlx_checkpoint import load_mlx_quantized
    from backends.mlx.runtime.runner import run

    directory = _bf16_quantized(tmp_path, tied)
    reference = _mlx_lm_logits(directory, all_float32=True)
    bf16_rows = _mlx_lm_logits(directory, all_float32=False)
    assert _gap(bf16_rows, reference) > 50 * TOLERANCE, "the control must see the bf16 rounding of the rows"

    model = load_mlx_quantized(directory, torch.float32)
    embedding = model.get_input_embeddings()
    assert embedding.scales.dtype == embedding.biases.dtype == torch.float32
    assert model.model.layers[0].self_attn.q_proj.scales.dtype == torch.bfloat16  # the others as stored
    wrapped = _Logits(model).eval()
    ids = torch.from_numpy(TOKENS)
    with torch.no_grad():
        eager = wrapped(ids)[0].numpy()
    assert _gap(eager, reference) < TOLERANCE

    # float32 activations in the CPU quantized products: by default they are rounded to int16 on AVX-512 VNNI
    # CPUs, a bound of its own (docs/cpu-kernels.md)
    program = export_to_pte(wrapped, (ids,), qmm_activations="float32")
    out = run(program.pte, [ids])[0]
    assert _gap(np.asarray(out)[0], reference) < TOLERANCE


def test_quantize_keeps_float32_embedding_scales_for_float32_activations():
    """--quantize of a bf16 checkpoint loaded as float32: the embedding's scales widen to float32 (its head,
    tied, shares them); the linears keep bf16 ones. Loaded as bf16, the embedding keeps bf16 too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from backends.mlx.llm.quantize.affine import quantize_model

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    for activations, embedding_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)):
        model = LlamaForCausalLM(config).to(torch.bfloat16).to(activations)
        quantize_model(model, 4, 64, stored=torch.bfloat16)
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        assert embedding.scales.dtype == embedding.biases.dtype == embedding_dtype
        assert head.scales is embedding.scales
        assert model.model.layers[0].mlp.up_proj.scales.dtype == torch.bfloat16
