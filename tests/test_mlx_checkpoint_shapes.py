"""An `mlx_lm.convert` directory whose tensors disagree with its config.json (scales shaped for group 128 under a
group-64 config, weights packed for 8 bits under a 4-bit config) is refused by tensor name; a per-layer entry in
config.json's "quantization" is honoured (and then the layer decodes as mlx-lm's own load does)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import backends.mlx  # noqa: F401  (before mlx.core: routes MLX's CPU GEMMs)
from backends.mlx.llm.quantize.mlx_checkpoint import layer_scheme, load_mlx_quantized
from backends.mlx.llm.quantize.modules import QuantizedLinear

LAYER = "model.layers.0.mlp.down_proj"
IDS = [[5, 17, 99, 3, 42, 7]]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One small random Llama, converted by mlx_lm at (bits, group) 4/64, 8/64 and 4/128."""
    from mlx_lm import convert
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.checkpoints import save_tokenizer

    d = tmp_path_factory.mktemp("mlxq")
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(d / "float")
    save_tokenizer(config.vocab_size, d / "float")
    out = {}
    for bits, group in ((4, 64), (8, 64), (4, 128)):
        out[bits, group] = d / f"q{bits}g{group}"
        convert(str(d / "float"), str(out[bits, group]), quantize=True, q_group_size=group, q_bits=bits,
                dtype="float32")
    return out


def _graft(converted, tmp_path, donor, names, layer_entry=None):
    """The 4-bit group-64 directory with LAYER's `names` tensors taken from the `donor` conversion."""
    from safetensors.torch import load_file, save_file

    target = tmp_path / "grafted"
    shutil.copytree(converted[4, 64], target)
    tensors = load_file(str(target / "model.safetensors"))
    other = load_file(str(converted[donor] / "model.safetensors"))
    for name in names:
        tensors[f"{LAYER}.{name}"] = other[f"{LAYER}.{name}"]
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "mlx"})
    if layer_entry is not None:
        config = json.loads((target / "config.json").read_text())
        config["quantization"][LAYER] = layer_entry
        config["quantization_config"] = config["quantization"]
        (target / "config.json").write_text(json.dumps(config))
    return target


def test_weights_packed_for_8_bits_under_a_4_bit_config_are_refused(converted, tmp_path):
    grafted = _graft(converted, tmp_path, (8, 64), ["weight", "scales", "biases"])
    with pytest.raises(ValueError, match=rf"^{LAYER}\.weight is uint32 \[256, 64\], packed for 8 bits; "
                                         r"config.json's 4 bits need uint32 \[256, 32\]$"):
        load_mlx_quantized(grafted, torch.float32)


def test_scales_shaped_for_group_128_under_a_group_64_config_are_refused(converted, tmp_path):
    grafted = _graft(converted, tmp_path, (4, 128), ["scales", "biases"])
    with pytest.raises(ValueError, match=rf"^{LAYER}\.scales is \[256, 2\], shaped for group size 128; "
                                         r"config.json's group size 64 needs \[256, 4\]$"):
        load_mlx_quantized(grafted, torch.float32)


def test_cli_export_refuses_the_mismatch_in_one_line(converted, tmp_path):
    from helpers import run_cli

    grafted = _graft(converted, tmp_path, (4, 128), ["scales", "biases"])
    done = run_cli("export", "--model", grafted, "--out", tmp_path / "x.pte", "--max-seq-len", "16")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"etmlx: error: {LAYER}.scales is [256, 2], shaped for group size 128; config.json's group size 64 "
        "needs [256, 4]")
    assert not (tmp_path / "x.pte").exists()


def test_per_layer_entry_is_honoured_and_decodes_as_mlx_lm(converted, tmp_path):
    import mlx.core as mx
    from mlx_lm import load

    grafted = _graft(converted, tmp_path, (8, 64), ["weight", "scales", "biases"],
                     layer_entry={"group_size": 64, "bits": 8})
    model = load_mlx_quantized(grafted, torch.float32)
    layer = model.get_submodule(LAYER)
    assert isinstance(layer, QuantizedLinear) and (layer.bits, layer.group_size) == (8, 64)
    assert model.get_submodule("model.layers.0.mlp.up_proj").bits == 4
    with torch.no_grad():
        ours = model(torch.tensor(IDS)).logits[0].numpy()
    reference, _ = load(str(grafted))
    theirs = np.array(reference(mx.array(IDS))[0])
    assert np.abs(theirs).max() > 0.5, "logits too flat for the comparison to say much"
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_layer_scheme_reads_the_per_layer_entry_then_the_defaults():
    quant = {"group_size": 64, "bits": 4, "mode": "affine", "a.b": {"group_size": 32, "bits": 8}, "a.c": False,
             "a.d": {"bits": 6}}
    assert layer_scheme(quant, "a.b") == (32, 8)
    assert layer_scheme(quant, "a.c") is None
    assert layer_scheme(quant, "a.d") == (64, 6)
    assert layer_scheme(quant, "a.e") == (64, 4)
    with pytest.raises(ValueError, match="a.e: config.json's quantization gives group size 0"):
        layer_scheme({"group_size": 0, "bits": 4}, "a.e")
