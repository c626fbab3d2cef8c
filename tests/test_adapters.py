"""`etmlx export --adapter DIR`: a LoRA adapter fused into the program decodes to the tokens its own library
gives with the same adapter (transformers + PEFT for PEFT's layout, mlx-lm for mlx-lm's, on a float and an
mlx-lm quantized base); a bad adapter is refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from adapter_helpers import (TARGETS, checkpoint, distinct, export, mlx_lm_adapter, mlx_lm_fused, mlx_lm_greedy,
                             peft_adapter, torch_greedy)
from backends.mlx.cli.main import main

# Whole decoder exports: the slow tier (make test), not make test-fast.
pytestmark = pytest.mark.slow


def test_peft_adapter_decodes_to_transformers_peft_tokens(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = checkpoint(tmp_path / "base")
    adapter = peft_adapter(base_dir, tmp_path / "peft")
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    base_tokens = torch_greedy(base)
    expected = torch_greedy(PeftModel.from_pretrained(base, str(adapter)).eval())  # unfused: x + s * B(A(x))
    distinct(expected, base_tokens)
    assert export(base_dir, tmp_path / "peft.pte", "--adapter", str(adapter)) == expected


def test_mlx_lm_adapter_decodes_to_mlx_lm_tokens(tmp_path):
    from mlx_lm import load

    base_dir = checkpoint(tmp_path / "base")
    adapter = mlx_lm_adapter(tmp_path / "mlx-adapter")
    expected = mlx_lm_greedy(load(str(base_dir), adapter_path=str(adapter))[0])
    distinct(expected, mlx_lm_greedy(load(str(base_dir))[0]))
    assert export(base_dir, tmp_path / "mlx.pte", "--adapter", str(adapter)) == expected


def test_adapter_on_a_quantized_checkpoint_is_fused_as_mlx_lm_fuses(tmp_path):
    """An mlx-lm 4-bit directory: dequantize, add the update, quantize again, as mlx_lm.fuse does; the tokens
    are those of mlx-lm's fused model."""
    from mlx_lm import convert, load

    base_dir = checkpoint(tmp_path / "base")
    quantized = tmp_path / "q4"
    convert(str(base_dir), str(quantized), quantize=True, q_group_size=64, q_bits=4, dtype="float32")
    adapter = mlx_lm_adapter(tmp_path / "mlx-adapter")
    theirs = mlx_lm_fused(load(str(quantized), adapter_path=str(adapter))[0])
    _assert_same_fused_tensors(quantized, adapter, theirs)
    # 24 steps: the 28th is a near tie in mlx-lm's own logits (its top two 2.7e-4 apart), which float32
    # rounding may break either way.
    steps = 24
    expected = mlx_lm_greedy(theirs, steps)
    distinct(expected, mlx_lm_greedy(load(str(quantized))[0], steps))
    assert export(quantized, tmp_path / "q.pte", "--adapter", str(adapter), steps=steps) == expected


def test_adapter_is_fused_before_quantizing(tmp_path):
    """--adapter with --quantize int4 on a float checkpoint: the fused weights are quantized, as mlx-lm's fused
    float model quantized with nn.quantize (mlx_lm.fuse, then mlx_lm.convert -q) decodes."""
    import mlx.nn as nn
    from mlx_lm import load

    base_dir = checkpoint(tmp_path / "base")
    adapter = mlx_lm_adapter(tmp_path / "mlx-adapter")
    theirs = mlx_lm_fused(load(str(base_dir), adapter_path=str(adapter))[0])
    nn.quantize(theirs, group_size=64, bits=4)
    expected = mlx_lm_greedy(theirs)
    unfused = load(str(base_dir))[0]
    nn.quantize(unfused, group_size=64, bits=4)
    distinct(expected, mlx_lm_greedy(unfused))
    assert export(base_dir, tmp_path / "fq.pte", "--adapter", str(adapter), "--quantize", "int4") == expected


def _assert_same_fused_tensors(quantized, adapter, theirs):
    """The fused model etmlx exports holds mlx-lm's fused integers, scales and biases, bit for bit."""
    from mlx.utils import tree_flatten

    from backends.mlx.llm.lora.adapter_files import read_adapter
    from backends.mlx.llm.lora.fuse import fuse_adapter
    from backends.mlx.llm.quantize.mlx_checkpoint import load_mlx_quantized

    ours = fuse_adapter(load_mlx_quantized(quantized, torch.float32), read_adapter(adapter)).state_dict()
    theirs = dict(tree_flatten(theirs.parameters()))
    fused = [f"model.layers.{i}.{key}.{part}" for i in range(2) for key in TARGETS for part in ("weight", "scales", "biases")]
    for name in fused:
        assert torch.equal(ours[name], torch.from_numpy(np.array(theirs[name]))), name


def _error(capsys, model_dir, tmp_path, adapter) -> str:
    assert main(["export", "--model", str(model_dir), "--out", str(tmp_path / "bad.pte"), "--adapter",
                 str(adapter)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("etmlx: error: --adapter "), lines
    return lines[-1]


def test_bad_adapters_are_refused_in_one_line(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    base_dir = checkpoint(tmp_path / "base")
    assert "not a directory" in _error(capsys, base_dir, tmp_path, tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds neither adapters.safetensors" in _error(capsys, base_dir, tmp_path, empty)
    import etmlx

    with pytest.raises(ValueError, match=r"^adapter \S+: holds neither adapters.safetensors"):  # the Python API's name
        etmlx.export(base_dir, tmp_path / "bad.pte", adapter=empty)

    no_config = mlx_lm_adapter(tmp_path / "no-config")
    (no_config / "adapter_config.json").unlink()
    assert "no adapter_config.json" in _error(capsys, base_dir, tmp_path, no_config)

    # The config's rank is not the weights' rank.
    rank = mlx_lm_adapter(tmp_path / "rank")
    config = json.loads((rank / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = 8
    (rank / "adapter_config.json").write_text(json.dumps(config))
    assert "rank mismatch: its weights have rank 4, adapter_config.json says 8" in _error(capsys, base_dir, tmp_path,
                                                                                            rank)
    # A and B of different ranks.
    peft = peft_adapter(base_dir, tmp_path / "peft")
    tensors = load_file(str(peft / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[name] = tensors[name][:, :3].contiguous()
    save_file(tensors, str(peft / "adapter_model.safetensors"))
    assert "model.layers.0.self_attn.q_proj: rank mismatch between its A [4, 128] and B [128, 3]" in \
        _error(capsys, base_dir, tmp_path, peft)

    # An adapter trained on a wider base model: its shapes are not this model's.
    wide = mlx_lm_adapter(tmp_path / "wide", hidden=192)
    assert "model.layers.0.mlp.down_proj: its update is 192x256 (out x in) but the base layer is 128x256" in \
        _error(capsys, base_dir, tmp_path, wide)
    # A layer this model does not have.
    foreign = mlx_lm_adapter(tmp_path / "foreign")
    tensors = load_file(str(foreign / "adapters.safetensors"))
    tensors = {k.replace("self_attn", "attn"): v for k, v in tensors.items()}
    save_file(tensors, str(foreign / "adapters.safetensors"))
    assert "model.layers.0.attn.q_proj is not a layer of this llama model" in \
        _error(capsys, base_dir, tmp_path, foreign)

    dora = mlx_lm_adapter(tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "dora"}))
    assert "fine_tune_type 'dora' is not supported" in _error(capsys, base_dir, tmp_path, dora)
    truncated = mlx_lm_adapter(tmp_path / "truncated")
    data = (truncated / "adapters.safetensors").read_bytes()
    (truncated / "adapters.safetensors").write_bytes(data[: len(data) // 2])
    assert "adapters.safetensors is not a readable safetensors file" in _error(capsys, base_dir, tmp_path, truncated)
    assert not (tmp_path / "bad.pte").exists()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_fused_model_equals_peft_unfused(tmp_path, family):
    """The fused eager model against PEFT's unfused one, logits within float32 rounding: GPT-2's Conv1D layers
    (weights stored [in, out], PEFT's fan_in_fan_out) and rsLoRA's alpha / sqrt(r) with per-layer alpha_pattern."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from backends.mlx.llm.lora.adapter_files import read_adapter
    from backends.mlx.llm.lora.fuse import fuse_adapter

    torch.manual_seed(5)
    if family == "gpt2":
        make = lambda: GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64))
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                            init_lora_weights=False)
    else:
        make = lambda: LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "gate_proj"], use_rslora=True,
                            alpha_pattern={"o_proj": 32}, init_lora_weights=False)
    base = make().eval()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    get_peft_model(base, config).save_pretrained(str(tmp_path / "adapter"))
    ids = torch.randint(0, 128, (1, 12))
    fresh = make().eval()
    fresh.load_state_dict(state)
    with torch.no_grad():
        plain = fresh(ids).logits
        expected = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).eval()(ids).logits
        fused = make().eval()
        fused.load_state_dict(state)
        got = fuse_adapter(fused, read_adapter(tmp_path / "adapter"))(ids).logits
    assert (expected - plain).abs().max() > 100 * (got - expected).abs().max()  # the adapter matters
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
