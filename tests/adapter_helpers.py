"""Shared by the LoRA adapter tests: a small random causal LM checkpoint, random adapters in mlx-lm's and PEFT's
layouts, exports, and the reference libraries' greedy tokens."""

from __future__ import annotations

import json

import numpy as np
import torch

import backends.mlx  # noqa: F401  (before mlx.core: routes MLX's CPU GEMMs)
import mlx.core as mx
from backends.mlx.cli.main import main
from backends.mlx.llm.decoder.loop import Decoder
from benchmarks.checkpoints import save_tokenizer

STEPS = 32
PROMPT = [5, 17, 99, 3, 42]
TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


def checkpoint(directory, hidden: int = 128, family: str = "llama"):
    """A small random Llama (or Qwen2: `family`) with a wider-than-default init (argmaxes far from ties) and a
    tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    config = config_class(vocab_size=256, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(3)
    model_class(config).eval().save_pretrained(directory)
    # transformers 5 writes rope_theta inside rope_parameters only, where mlx-lm does not look.
    saved = json.loads((directory / "config.json").read_text())
    saved["rope_theta"] = saved["rope_parameters"]["rope_theta"]
    (directory / "config.json").write_text(json.dumps(saved))
    save_tokenizer(config.vocab_size, directory)
    return directory


def peft_adapter(base_dir, directory, rank: int = 4, alpha: int = 16, seed: int = 7):
    """A PEFT LoRA adapter with random A and B (init_lora_weights=False: B is not zero, so it changes tokens)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=[t.split(".")[-1] for t in TARGETS],
                        init_lora_weights=False, rank_pattern={"down_proj": 2 * rank})
    get_peft_model(base, config).save_pretrained(str(directory))
    return directory


def mlx_lm_adapter(directory, hidden: int = 128, rank: int = 4, scale: float = 2.0, seed: int = 11):
    """An adapter in mlx-lm's layout (what mlx_lm.lora saves): lora_a [in, r], lora_b [r, out] per layer."""
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.v_proj": (hidden, 64), "mlp.down_proj": (256, hidden)}
    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(2):
        for key in TARGETS:
            fan_in, fan_out = shapes[key]
            name = f"model.layers.{layer}.{key}"
            weights[f"{name}.lora_a"] = mx.array(rng.uniform(-1, 1, (fan_in, rank)).astype(np.float32) / fan_in ** 0.5)
            weights[f"{name}.lora_b"] = mx.array(rng.normal(0, 0.05, (rank, fan_out)).astype(np.float32))
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": 2,
              "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(TARGETS)}}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def export(model_dir, out, *flags, steps: int = STEPS):
    assert main(["export", "--model", str(model_dir), "--out", str(out), "--max-seq-len", "96", *flags]) == 0
    return Decoder(out).generate(PROMPT, steps).tokens


def torch_greedy(model) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(STEPS):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(PROMPT):].tolist()


def mlx_lm_greedy(model, steps: int = STEPS) -> list[int]:
    from mlx_lm.generate import generate_step

    greedy = lambda logits: mx.argmax(logits, axis=-1)
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=steps, sampler=greedy)]


def mlx_lm_fused(model):
    """What `mlx_lm.fuse` does to the LoRA layers of a model loaded with its adapter (mlx_lm/fuse.py)."""
    from mlx.utils import tree_unflatten

    fused = [(name, module.fuse()) for name, module in model.named_modules() if hasattr(module, "fuse")]
    model.update_modules(tree_unflatten(fused))
    return model


def distinct(tokens, base):
    assert len(set(tokens)) > 6, f"degenerate reference, the comparison would say little: {tokens}"
    assert tokens != base, "the adapter does not change the tokens: the test would not see it ignored"


