"""Every supported family, as a user meets it: a tiny random checkpoint with sharp weights (initializer_range 0.2,
untied head, each family's quirks switched on), `etmlx export --model DIR` with the defaults (pipelined), then
greedy decoding through the runtime equals transformers' own greedy `generate` on the same checkpoint; and with
`--quantize int8`, every token is one the float model ranks within a stated log-probability of its best.

Sharp weights matter: at transformers' default init (0.02) the logits are nearly flat and position, scale or
mask mistakes barely move them; at 0.2 a wrong multiplier, rotary dimension or window changes the tokens.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T

from backends.mlx.cli.main import main
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.model_support import TESTED

# Whole decoder exports: the slow tier (make test), not make test-fast.
pytestmark = pytest.mark.slow

VOCAB = 128
PROMPT = [5, 17, 99, 3, 42, 7]
STEPS = 12
MAX_SEQ_LEN = 32
# int8 (group 64): each greedy token's float log-probability, in the int8 program's own context, is within this
# many nats of the float model's best token there (the program itself equals the eager int8 model: export
# verifies it). Measured worst over these families (the test prints each): olmo 0.159 (clip_qkv clamps q/k/v at
# 2.0, where int8 rounding moves which values clip), qwen2_moe 0.162 (its experts are quantized too), the others
# <= 0.095.
INT8_NATS = 0.2

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=0)
SLIDING = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])  # the window is exceeded
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

CONFIGS = {
    "llama": lambda: T.LlamaConfig(**COMMON),
    "mistral": lambda: T.MistralConfig(**COMMON, sliding_window=4),
    "qwen2": lambda: T.Qwen2Config(**COMMON),
    "qwen3": lambda: T.Qwen3Config(**COMMON, head_dim=16),
    "gpt2": lambda: T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                 initializer_range=0.2, bos_token_id=None, eos_token_id=None),
    "olmo": lambda: T.OlmoConfig(**COMMON, clip_qkv=2.0),
    "gemma": lambda: T.GemmaConfig(**COMMON, head_dim=16, hidden_act="gelu_pytorch_tanh"),
    "gemma2": lambda: T.Gemma2Config(**COMMON, head_dim=16, **SLIDING, attn_logit_softcapping=5.0,
                                     final_logit_softcapping=8.0, query_pre_attn_scalar=8),
    "gemma3_text": lambda: T.Gemma3TextConfig(**COMMON, head_dim=16, **SLIDING, query_pre_attn_scalar=8,
                                              rope_local_base_freq=100.0),
    "granite": lambda: T.GraniteConfig(**COMMON, embedding_multiplier=3.0, residual_multiplier=0.5,
                                       attention_multiplier=0.3, logits_scaling=2.0),
    "smollm3": lambda: T.SmolLM3Config(**COMMON, no_rope_layer_interval=2),
    "starcoder2": lambda: T.Starcoder2Config(**COMMON, sliding_window=4),
    "phi": lambda: T.PhiConfig(**COMMON, partial_rotary_factor=0.5, qk_layernorm=True),
    "phi3": lambda: T.Phi3Config(**COMMON, partial_rotary_factor=0.5),
    "olmo2": lambda: T.Olmo2Config(**COMMON),
    "stablelm": lambda: T.StableLmConfig(**COMMON, partial_rotary_factor=0.25, use_qkv_bias=True),
    "cohere": lambda: T.CohereConfig(**COMMON, logit_scale=0.5, use_qk_norm=True),
    "gpt_neox": lambda: T.GPTNeoXConfig(**COMMON, rotary_pct=0.25),
    "falcon": lambda: T.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     initializer_range=0.2, bos_token_id=None, eos_token_id=None),
    "qwen2_moe": lambda: T.Qwen2MoeConfig(**COMMON, **MOE, num_experts=4, shared_expert_intermediate_size=32),
    "qwen3_moe": lambda: T.Qwen3MoeConfig(**COMMON, **MOE, num_experts=4),
    "mixtral": lambda: T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    # multi-head latent attention (low-rank q and kv, split rotary/non-rotary head dims), grouped routing
    "deepseek_v3": lambda: T.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, **MOE, n_routed_experts=4,
                                              first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=2,
                                              topk_group=1),
}


def test_the_tested_list_is_this_table():
    assert sorted(CONFIGS) == sorted(TESTED)


def _checkpoint(tmp_path, family: str):
    config = CONFIGS[family]()
    torch.manual_seed(7)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    directory = tmp_path / family
    model.save_pretrained(directory)
    return directory


def _export(directory, out, *flags):
    assert main(["export", "--model", str(directory), "--out", str(out), "--max-seq-len", str(MAX_SEQ_LEN),
                 *flags]) == 0
    return out


def _transformers_greedy(directory) -> list[int]:
    model = T.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS)
    return out[0, len(PROMPT):].tolist()


def _float_logprobs(directory, tokens) -> torch.Tensor:
    """The float model's log-probabilities at each generated position, teacher-forced on `tokens`."""
    model = T.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_greedy_tokens_equal_transformers(tmp_path, monkeypatch, family):
    directory = _checkpoint(tmp_path, family)
    expected = _transformers_greedy(directory)
    assert len(set(expected)) > 3, f"degenerate reference, the comparison would say little: {expected}"
    pte = _export(directory, tmp_path / "f.pte")
    assert Decoder(pte).generate(PROMPT, STEPS).tokens == expected
    # The device kernel set (what CUDA and Metal builds run: MLX's attention, without the mask where the key
    # window makes it redundant, and a greedy pick without noise), chosen when the program loads.
    monkeypatch.setenv("ETMLX_KERNELS", "device")
    assert Decoder(pte).generate(PROMPT, STEPS).tokens == expected


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_int8_tokens_are_the_float_models_choices(tmp_path, family):
    directory = _checkpoint(tmp_path, family)
    pte = _export(directory, tmp_path / "q8.pte", "--quantize", "int8")
    tokens = Decoder(pte).generate(PROMPT, STEPS).tokens
    logprobs = _float_logprobs(directory, tokens)
    chosen = logprobs[torch.arange(STEPS), torch.tensor(tokens)]
    worst = (logprobs.max(dim=-1).values - chosen).max().item()
    print(f"{family} int8: worst gap to the float model's best token {worst:.4f} nats")
    assert worst <= INT8_NATS, (family, worst)


@pytest.mark.parametrize("config,message", [
    (lambda: T.Gemma3TextConfig(**COMMON, head_dim=16, use_bidirectional_attention=True),
     "use_bidirectional_attention=True is not supported"),
    (lambda: T.LlamaConfig(**COMMON, attention_chunk_size=8), "attention_chunk_size"),
    (lambda: T.GptOssConfig(**{**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
                               "layer_types": ["sliding_attention", "full_attention"]}),
     "s_aux"),
])
def test_what_etmlx_does_not_implement_is_refused_by_name(tmp_path, capsys, config, message):
    torch.manual_seed(0)
    directory = tmp_path / "m"
    T.AutoModelForCausalLM.from_config(config()).save_pretrained(directory)
    rc = main(["export", "--model", str(directory), "--out", str(tmp_path / "x.pte"), "--max-seq-len", "32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err and err[-1].startswith("etmlx: error: ") and message in err[-1], (rc, err)
    assert not (tmp_path / "x.pte").exists()


# mlx-community's quantized repos are `mlx_lm.convert -q` directories: exported as they are, every greedy token
# is one the float model it came from ranks within INT8_NATS of its best (8-bit, group 64).
MLX_LM_FAMILIES = ("qwen3", "mistral", "gemma3_text", "phi3")


@pytest.mark.parametrize("family", MLX_LM_FAMILIES)
def test_mlx_lm_quantized_directory_decodes_the_float_models_choices(tmp_path, family):
    import json

    from mlx_lm import convert

    from benchmarks.checkpoints import save_tokenizer

    directory = _checkpoint(tmp_path, family)
    saved = json.loads((directory / "config.json").read_text())
    # mlx-lm reads rope settings at the top level only (transformers 5 nests them in rope_parameters).
    for key, value in (saved.get("rope_parameters") or {}).items():
        saved.setdefault(key, value)
    (directory / "config.json").write_text(json.dumps(saved))
    save_tokenizer(VOCAB, directory)
    quantized = tmp_path / f"{family}-8bit"
    convert(str(directory), str(quantized), quantize=True, q_group_size=64, q_bits=8, dtype="float32")
    pte = _export(quantized, tmp_path / "m.pte")
    tokens = Decoder(pte).generate(PROMPT, STEPS).tokens
    logprobs = _float_logprobs(directory, tokens)
    worst = (logprobs.max(dim=-1).values - logprobs[torch.arange(STEPS), torch.tensor(tokens)]).max().item()
    print(f"{family} mlx-lm 8-bit: worst gap to the float model's best token {worst:.4f} nats")
    assert worst <= INT8_NATS, (family, worst, tokens)
