"""`etmlx bench decode --shape`: the real-size benchmark's code paths on a tiny shape (never timings), and the
GGUF files written for its llama.cpp baseline read back to the weights they came from."""

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import decode_shapes, gguf_checkpoint
from benchmarks import checkpoints as ckpt

pytestmark = pytest.mark.bench

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    cache = tmp_path_factory.mktemp("shapes")
    shapes = dict(ckpt.SHAPES, **{"tiny-qwen2": dict(TINY, architecture="qwen2", rope_theta=1e6)})
    original, ckpt.SHAPES = ckpt.SHAPES, shapes
    # Every engine gets every prompt length: on a loaded machine a warm-up can fall under the slow-engine rate,
    # and which lengths the report has must not depend on timing.
    slow, decode_shapes.SLOW_DECODE_TOKENS_PER_S = decode_shapes.SLOW_DECODE_TOKENS_PER_S, 0.0
    try:
        settings = decode_shapes.ShapeSettings(prompt_lens=(8, 16), steps=4, repeats=1, max_seq_len=32,
                                               bf16_export=True)
        return decode_shapes.run("tiny-qwen2", ("int4",), settings, cache, log=lambda *_: None)
    finally:
        ckpt.SHAPES = original
        decode_shapes.SLOW_DECODE_TOKENS_PER_S = slow


def test_report_has_every_engine_and_the_floor(report):
    (d,) = report["dtypes"]
    engines = {"etmlx", "mlx_lm", "mlx_lm_bflo"} | ({"llama_cpp_q4_0", "llama_cpp_f16"} if report["llama_cpp"] else set())
    assert set(d["results"]) == engines and set(d["memory"]) == engines
    for r in d["results"].values():
        assert r["decode_tokens_per_s"] > 0 and r["prefill_8_tokens_per_s"] > 0 and r["prefill_16_tokens_per_s"] > 0
    assert d["export"]["export_wall_s"] > 0 and d["export"]["export_peak_rss_bytes"] > 10e6
    assert decode_shapes.floor_tokens_per_s(report, d) > 0
    text = decode_shapes.format_report(report)
    assert "bandwidth floor" in text and "etmlx decode / bandwidth floor" in text


def test_report_has_the_export_rss_over_the_weights(report):
    """The export's peak RSS over the directory's safetensors bytes, and (--bf16-export) that of the bfloat16
    checkpoint exported with --quantize int4, whose bytes are half the float32 checkpoint's."""
    (d,) = report["dtypes"]
    e, b = d["export"], report["bf16_export"]
    assert e["peak_rss_over_weights"] == pytest.approx(e["export_peak_rss_bytes"] / e["weight_bytes"])
    float_bytes = sum(f.stat().st_size for f in ckpt.cached(ckpt.CheckpointSpec(**TINY, architecture="qwen2",
                                                                                rope_theta=1e6),
                                                            Path(d["checkpoint"]).parent).glob("*.safetensors"))
    assert b["weight_bytes"] == pytest.approx(float_bytes / 2, rel=0.05)
    assert b["peak_rss_over_weights"] == pytest.approx(b["export_peak_rss_bytes"] / b["weight_bytes"])
    text = decode_shapes.format_report(report)
    assert "export of the mlx-lm directory: peak RSS" in text and "of the bfloat16 checkpoint" in text


def test_etmlx_decodes_mlx_lm_tokens_from_the_same_integers(report):
    (d,) = report["dtypes"]
    assert d["greedy_agreement_with_etmlx"]["mlx_lm"] == 5  # prefill + 4 steps, float32 activations on both


def test_parameter_count_matches_the_checkpoint(tmp_path):
    spec = ckpt.CheckpointSpec(**TINY, architecture="qwen2")
    model = ckpt.load_torch(ckpt.cached(spec, tmp_path), "float32")
    assert spec.parameters == sum(p.numel() for p in model.parameters())
    config = json.loads((tmp_path / spec.name / "config.json").read_text())
    assert config["rope_theta"] == spec.rope_theta and config["tie_word_embeddings"]


def test_bfloat16_quantized_directory_has_bfloat16_scales(tmp_path):
    """--quantized-dtype bfloat16: mlx_lm.convert --dtype bfloat16 beside (not over) the float32-scale directory."""
    import mlx.core as mx

    float_dir = ckpt.cached(ckpt.CheckpointSpec(**TINY, architecture="qwen2"), tmp_path)
    plain = ckpt.cached_quantized(float_dir, "int4", tmp_path)
    bf16 = ckpt.cached_quantized(float_dir, "int4", tmp_path, "bfloat16")
    assert bf16 != plain and ckpt.cached_quantized(float_dir, "int4", tmp_path, "bfloat16") == bf16
    load = lambda d: {k: v for f in sorted(d.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}
    ours, theirs = load(bf16), load(plain)
    assert ours.keys() == theirs.keys()
    scales = [k for k in ours if k.endswith(".scales")]
    assert scales and all(ours[k].dtype == mx.bfloat16 and theirs[k].dtype == mx.float32 for k in scales)
    assert all(ours[k].dtype == mx.uint32 for k in ours if k.endswith(".weight") and theirs[k].dtype == mx.uint32)
    with pytest.raises(ValueError, match="float dtype must be one of float32, bfloat16"):
        ckpt.cached_quantized(float_dir, "int4", tmp_path, "float16")
    with pytest.raises(ValueError, match="--quantized-dtype must be one of"):
        decode_shapes.ShapeSettings(quantized_float_dtype="int8")


def test_unknown_shape_is_one_line_error(tmp_path):
    with pytest.raises(ValueError, match="--shape must be one of qwen2.5-0.5b"):
        decode_shapes.run("qwen-9000", ("int4",), cache_dir=tmp_path)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "F16"])
def test_gguf_reads_back_to_the_checkpoint(tmp_path, architecture, qtype):
    import gguf
    from safetensors.numpy import load_file

    spec = ckpt.CheckpointSpec(**TINY, architecture=architecture)
    float_dir = ckpt.cached(spec, tmp_path)
    reader = gguf.GGUFReader(str(gguf_checkpoint.cached_gguf(float_dir, qtype)))
    tensors = {t.name: t for t in reader.tensors}
    weights = load_file(str(next(float_dir.glob("*.safetensors"))))
    assert "output.weight" not in tensors  # tied: llama.cpp multiplies by token_embd
    heads = {"attn_q": spec.num_attention_heads, "attn_k": spec.num_key_value_heads}
    for key, name in gguf_checkpoint._tensor_names(spec.num_hidden_layers).items():
        if key not in weights:
            continue
        t = tensors[name]
        back = gguf.quants.dequantize(t.data, t.tensor_type).reshape(weights[key].shape)
        kind = name.split(".")[-2]
        if architecture == "llama" and kind in heads and name.endswith("weight"):
            n = heads[kind]  # undo llama.cpp's row order: adjacent rotary pairs back to halves
            back = back.reshape(n, back.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(back.shape)
        tolerance = {"Q4_0": 0.15, "Q8_0": 0.01, "F16": 1e-3}[qtype] * np.abs(weights[key]).max()
        assert np.abs(back - weights[key]).max() <= tolerance, name
        if weights[key].ndim == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
    assert reader.fields["general.architecture"].contents() == architecture
