"""An mlx-lm-style 4-/8-bit directory written directly, for shapes whose float checkpoint would not fit.

`benchmarks/checkpoints.py` builds a float32 checkpoint and has `mlx_lm.convert` quantize it: at the Llama-3.1-8B
shape that is 32 GB of float32 weights, more than this machine's memory. Here every quantized linear and the
embedding are written as mlx-lm stores them (uint32 packed integers, bfloat16 scales and biases, config.json's
"quantization" entry) from seeded random integers, one decoder layer per safetensors shard, so at most one
layer's tensors exist at a time and no float weight is ever made. The integers are uniform over the 2^bits levels
and each group's scale and bias map them onto [-RANGE, RANGE] (a random group-wise scale jitter keeps the
groups distinct), the spread of checkpoints.py's 0.05 initializer.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks import checkpoints as ckpt

GROUP_SIZE = 64
RANGE = 0.1  # weights in [-RANGE, RANGE]: about checkpoints.py's N(0, 0.05) spread


def _linear(prefix: str, out_features: int, in_features: int, bits: int, g: torch.Generator) -> dict:
    packed = torch.randint(0, 2**32, (out_features, in_features * bits // 32), generator=g, dtype=torch.int64)
    groups = (out_features, in_features // GROUP_SIZE)
    jitter = 1 + 0.25 * (torch.rand(groups, generator=g) - 0.5)
    scales = (2 * RANGE / (2**bits - 1)) * jitter
    return {f"{prefix}.weight": packed.to(torch.uint32), f"{prefix}.scales": scales.to(torch.bfloat16),
            f"{prefix}.biases": (-RANGE * jitter).to(torch.bfloat16)}


def _layer(spec: ckpt.CheckpointSpec, index: int, bits: int, g: torch.Generator) -> dict:
    h, i = spec.hidden_size, spec.intermediate_size
    kv = h // spec.num_attention_heads * spec.num_key_value_heads
    p = f"model.layers.{index}"
    tensors = {}
    for name, out_f, in_f in (("self_attn.q_proj", h, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
                              ("self_attn.o_proj", h, h), ("mlp.gate_proj", i, h), ("mlp.up_proj", i, h),
                              ("mlp.down_proj", h, i)):
        tensors.update(_linear(f"{p}.{name}", out_f, in_f, bits, g))
    if spec.architecture == "qwen2":  # q, k and v carry biases in float
        for name, size in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            tensors[f"{p}.self_attn.{name}.bias"] = (0.02 * torch.randn(size, generator=g)).to(torch.bfloat16)
    for name in ("input_layernorm", "post_attention_layernorm"):
        tensors[f"{p}.{name}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return tensors


def build(spec: ckpt.CheckpointSpec, directory: Path, bits: int = 4) -> None:
    """Write the directory: config.json (with mlx-lm's quantization entry), a tokenizer and one shard per layer
    (the embedding, final norm and head in shards of their own) with an index, as `mlx_lm.convert -q` would."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(spec.seed)
    shards = [lambda: _linear("model.embed_tokens", spec.vocab_size, spec.hidden_size, bits, g)]
    shards += [lambda i=i: _layer(spec, i, bits, g) for i in range(spec.num_hidden_layers)]
    tail = lambda: {"model.norm.weight": torch.ones(spec.hidden_size, dtype=torch.bfloat16),  # noqa: E731
                    **({} if spec.tie_word_embeddings else
                       _linear("lm_head", spec.vocab_size, spec.hidden_size, bits, g))}
    shards.append(tail)
    ckpt.save_shards(directory, shards, "mlx")  # one layer's tensors at a time
    config = ckpt._config(spec).to_dict()
    quantization = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    # mlx-lm writes both keys; it reads rope_theta at the top level (checkpoints.build says why)
    config.update(quantization=quantization, quantization_config=quantization, rope_theta=spec.rope_theta,
                  torch_dtype="bfloat16")
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    ckpt.save_tokenizer(spec.vocab_size, directory)
    (directory / "bench_spec.json").write_text(json.dumps({**asdict(spec), "packed_bits": bits}))


def cached(spec: ckpt.CheckpointSpec, cache_dir: Path, bits: int = 4) -> Path:
    """The packed directory for `spec` under `cache_dir`, built on first use."""
    directory = Path(cache_dir) / f"{spec.name}-packed-int{bits}-g{GROUP_SIZE}-bfloat16"
    marker = directory / "bench_spec.json"
    if not (marker.is_file() and json.loads(marker.read_text()) == {**asdict(spec), "packed_bits": bits}):
        build(spec, directory, bits)
    return directory


def weight_bytes(directory: Path) -> int:
    """The safetensors files' bytes: what an export's peak RSS is measured against."""
    return sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))
