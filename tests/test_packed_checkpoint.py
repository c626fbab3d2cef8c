"""Checkpoints the real-size benchmark writes without a float copy: the packed mlx-lm directory (the 8B shape's)
and the bfloat16 Hugging Face checkpoint cast tensor by tensor; `etmlx bench decode --shape` on a packed shape."""

import json

import pytest
import torch

from benchmarks import checkpoints as ckpt
from benchmarks import decode_shapes, packed_checkpoint, speculative_shape

pytestmark = pytest.mark.bench

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    cache = tmp_path_factory.mktemp("packed")
    shapes = dict(ckpt.SHAPES, **{"tiny-packed": TINY})
    original, ckpt.SHAPES = (ckpt.SHAPES, ckpt.PACKED_SHAPES), shapes
    ckpt.PACKED_SHAPES = ("tiny-packed",)
    slow, decode_shapes.SLOW_DECODE_TOKENS_PER_S = decode_shapes.SLOW_DECODE_TOKENS_PER_S, 0.0
    try:
        settings = decode_shapes.ShapeSettings(prompt_lens=(8,), steps=4, repeats=1, max_seq_len=16)
        return decode_shapes.run("tiny-packed", ("int4",), settings, cache, log=lambda *_: None)
    finally:
        ckpt.SHAPES, ckpt.PACKED_SHAPES = original
        decode_shapes.SLOW_DECODE_TOKENS_PER_S = slow


def test_packed_shape_runs_etmlx_and_mlx_lm_on_the_same_integers(report):
    (d,) = report["dtypes"]
    assert set(d["results"]) == {"etmlx", "mlx_lm", "mlx_lm_bflo"}  # no float weights: no GGUF, no llama.cpp
    assert d["greedy_agreement_with_etmlx"]["mlx_lm"] == 5  # prefill + 4 steps
    assert d["export"]["peak_rss_over_weights"] > 0
    text = decode_shapes.format_report(report)
    assert "bfloat16 scales" in text and "a packed shape has no float weights" in text


def test_packed_directory_is_what_mlx_lm_convert_writes(tmp_path):
    """uint32 integers, bfloat16 scales and biases of mlx-lm's shapes; config.json's quantization entry; values
    spread over [-RANGE, RANGE] (not all one level)."""
    from safetensors.torch import load_file

    from backends.mlx.custom_kernel_ops.quantized import dequantize

    spec = ckpt.CheckpointSpec(**TINY)
    directory = packed_checkpoint.cached(spec, tmp_path)
    tensors = {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    config = json.loads((directory / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    q = "model.layers.1.mlp.down_proj"
    assert tensors[q + ".weight"].dtype == torch.uint32 and tuple(tensors[q + ".weight"].shape) == (64, 128 // 8)
    assert tensors[q + ".scales"].dtype == torch.bfloat16 and tuple(tensors[q + ".scales"].shape) == (64, 2)
    w = dequantize(tensors[q + ".weight"], tensors[q + ".scales"], tensors[q + ".biases"], 64, 4, torch.float32)
    assert w.abs().max() <= 1.2 * packed_checkpoint.RANGE and w.std() > 0.3 * packed_checkpoint.RANGE
    assert "lm_head.weight" in tensors  # untied, as the 8B shape
    assert packed_checkpoint.weight_bytes(directory) == sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def test_bfloat16_checkpoint_is_the_float32_one_cast(tmp_path):
    from safetensors.torch import load_file

    float_dir = ckpt.cached(ckpt.CheckpointSpec(**TINY), tmp_path)
    bf16 = ckpt.cached_bfloat16(float_dir)
    ours = {k: v for f in sorted(bf16.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    theirs = {k: v for f in sorted(float_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k].to(torch.bfloat16)) for k in ours)
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert ckpt.cached_bfloat16(float_dir) == bf16  # cached


def test_packed_shape_is_refused_where_a_float_checkpoint_is_needed(tmp_path):
    with pytest.raises(ValueError, match="llama-3.1-8b is built packed"):
        speculative_shape._programs("llama-3.1-8b", tmp_path, 8, print)
