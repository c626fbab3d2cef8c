"""Tiny Llama, Qwen2 and GPT-2 models (random weights, made here) lower whole into the delegate.

These are full-sequence forwards without a KV cache: the op coverage a causal LM needs. They use
transformers' eager attention: exporting its SDPA path hits a stride mismatch when ExecuTorch
decomposes scaled_dot_product_attention (a `view` of the decomposed output fails), which lowering
SDPA whole to MLX's fused kernel will remove.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from backends.mlx.exporter.export import export_to_pte
from backends.mlx.llm.sampler.export import export_sampling_head
from backends.mlx.llm.sampler.head import SamplingHead
from backends.mlx.runtime.runner import load_method

# Whole decoder exports: the slow tier (make test), not make test-fast.
pytestmark = pytest.mark.slow

VOCAB = 96


def _llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attn_implementation="eager"))


def _qwen2():
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attn_implementation="eager"))


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=0, eos_token_id=1, attn_implementation="eager"))


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("make", [_llama, _qwen2, _gpt2], ids=["llama", "qwen2", "gpt2"])
def test_forward_is_fully_delegated_and_matches_eager(make):
    torch.manual_seed(0)
    model = Logits(make().eval())
    ids = torch.randint(0, VOCAB, (2, 9))
    result = export_to_pte(model, (ids,))
    assert result.ops_outside == 0, result.summary()
    with torch.no_grad():
        expected = model(ids)
    out = load_method(result.pte).execute([ids])[0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_sampling_head_on_a_language_model(make):
    torch.manual_seed(0)
    model = Logits(make().eval())
    ids = torch.randint(0, VOCAB, (2, 7))
    result = export_sampling_head(model, (ids,), strict=False)  # HF modules do not trace under strict
    assert result.ops_outside == 0, result.summary()
    method = load_method(result.pte)
    with torch.no_grad():
        last = model(ids)[:, -1, :]
        greedy = method.execute([ids, torch.tensor(0.0), torch.tensor(3)])[0]
        assert torch.equal(greedy, last.argmax(-1))
        head = SamplingHead(model)
        for seed in range(5):
            sampled = method.execute([ids, torch.tensor(0.8), torch.tensor(seed)])[0]
            assert torch.equal(sampled, head(ids, temperature=torch.tensor(0.8), seed=torch.tensor(seed)))


class _Attention(torch.nn.Module):
    def __init__(self, causal=False, gqa=False, masked=False):
        super().__init__()
        self.causal, self.gqa, self.masked = causal, gqa, masked

    def forward(self, q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask if self.masked else None, is_causal=self.causal, enable_gqa=self.gqa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["plain", "causal", "gqa_causal", "bool_mask", "float_mask"])
def test_sdpa_lowers_to_the_fused_kernel_and_matches_eager(kind, dtype):
    torch.manual_seed(0)
    b, h, hkv, length, d = 2, 4, (2 if "gqa" in kind else 4), 6, 8
    q = torch.randn(b, h, length, d).to(dtype)
    k = torch.randn(b, hkv, length, d).to(dtype)
    v = torch.randn(b, hkv, length, d).to(dtype)
    if kind == "bool_mask":
        mask = torch.rand(b, 1, length, length) > 0.3
        mask[..., 0] = True  # every query attends somewhere
    else:
        mask = (torch.randn(b, 1, length, length) * 2).to(dtype)
    module = _Attention(causal="causal" in kind, gqa="gqa" in kind, masked="mask" in kind)
    result = export_to_pte(module, (q, k, v, mask))
    assert result.ops_outside == 0, result.summary()
    out = load_method(result.pte).execute([q, k, v, mask])[0]
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out, module(q, k, v, mask), atol=tol, rtol=tol)


def test_llama_with_sdpa_attention_is_fully_delegated():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         attn_implementation="sdpa"))
    wrapped = Logits(model.eval())
    ids = torch.randint(0, VOCAB, (1, 9))
    result = export_to_pte(wrapped, (ids,))
    assert result.ops_outside == 0, result.summary()
    with torch.no_grad():
        torch.testing.assert_close(load_method(result.pte).execute([ids])[0], wrapped(ids), atol=1e-5, rtol=1e-5)
