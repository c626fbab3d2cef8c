"""`--quantize` read tensor by tensor (llm/quantize/streamed.py) gives the model the whole-model path gives:
from_pretrained in the activation dtype, then quantize_model. Every packed weight, scale, bias and float tensor is
compared bit for bit, over checkpoints in bfloat16 and float32, tied and untied, with and without the embedding
quantized, under float32 and bfloat16 activations, and a row-blocked quantize_tensor equals one call."""

from __future__ import annotations

import json

import pytest
import torch

from backends.mlx.llm.quantize import affine
from backends.mlx.llm.quantize.affine import quantize_model, quantize_tensor
from backends.mlx.llm.quantize.streamed import load_quantized


def _checkpoint(tmp_path, architecture: str, stored: torch.dtype, tied: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    kind = {"llama": LlamaConfig, "qwen2": Qwen2Config}[architecture]
    config = kind(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(stored)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a tensor left unread would show
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1 if "norm" in name else 0))
    directory = tmp_path / f"{architecture}-{stored}-{tied}"
    model.save_pretrained(directory)
    return directory


def _whole(directory, dtype, bits, group, embeddings, stored):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, attn_implementation="eager").eval()
    return quantize_model(model, bits, group, embeddings=embeddings, stored=stored)


def _tensors(model) -> dict:
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


@pytest.mark.parametrize("architecture,stored,tied,dtype,bits,embeddings", [
    ("qwen2", torch.bfloat16, True, torch.float32, 4, True),
    ("llama", torch.bfloat16, False, torch.float32, 8, True),
    ("llama", torch.bfloat16, True, torch.float32, 4, False),
    ("qwen2", torch.float32, False, torch.float32, 4, True),
    ("llama", torch.float32, True, torch.bfloat16, 8, True),
])
def test_streamed_quantization_equals_the_whole_model_path(tmp_path, architecture, stored, tied, dtype, bits,
                                                           embeddings):
    from transformers import AutoConfig

    directory = _checkpoint(tmp_path, architecture, stored, tied)
    config_dtype = json.loads((directory / "config.json").read_text()).get("dtype")
    assert config_dtype == str(stored).removeprefix("torch.")
    whole = _whole(directory, dtype, bits, 64, embeddings, stored)
    streamed = load_quantized(directory, AutoConfig.from_pretrained(str(directory)), dtype, bits, 64, embeddings,
                              stored)
    assert streamed is not None
    expected, got = _tensors(whole), _tensors(streamed)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert [type(m) for m in streamed.modules()] == [type(m) for m in whole.modules()]
    if tied:  # the head is the embedding's tensor, once
        assert streamed.lm_head.weight is streamed.get_input_embeddings().weight


def test_a_checkpoint_with_foreign_names_is_left_to_from_pretrained(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    directory = _checkpoint(tmp_path, "llama", torch.bfloat16, False)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.extra.weight"] = torch.zeros(4)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = AutoConfig.from_pretrained(str(directory))
    assert load_quantized(directory, config, torch.float32, 4, 64, True, torch.bfloat16) is None


def test_row_blocks_quantize_as_one_call(monkeypatch):
    weight = (torch.randn(3, 40, 256) * torch.logspace(-1, 1, 40).unsqueeze(1)).to(torch.bfloat16)
    whole = quantize_tensor(weight, 64, 4)
    monkeypatch.setattr(affine, "QUANTIZE_BLOCK", 7 * 256)  # blocks of 7 rows, the last one short
    blocked = quantize_tensor(weight, 64, 4)
    for a, b in zip(whole, blocked):
        assert a.shape == b.shape and torch.equal(a, b)
