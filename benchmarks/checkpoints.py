"""A local Llama checkpoint with seeded random weights, for `etmlx bench decode`.

Nothing is downloaded: the weights come from `torch.manual_seed`, and the tokenizer is a trivial
word-level one (token i is the word "t<i>") built with the `tokenizers` library, only so that
loaders that insist on tokenizer files (mlx-lm) find them. Checkpoints are cached by size and dtype,
so a rerun loads them instead of rebuilding.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# ~100M parameters: 2 x 24.6M (untied embedding and head) + 8 layers x 6.3M.
BENCH_SIZE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=12, num_key_value_heads=4)
# A CI smoke size: every code path of the benchmark, in seconds.
QUICK_SIZE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)

# Real sizes for `etmlx bench decode --shape NAME`: the published models' shapes (config.json of
# Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-1.5B, meta-llama/Llama-3.2-1B; Llama 3.2's rope scaling is left out,
# which changes no cost), with random weights.
SHAPES = {
    "qwen2.5-0.5b": dict(architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen2.5-1.5b": dict(architecture="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         tie_word_embeddings=True, rope_theta=1000000.0),
    "llama-3.2-1b": dict(architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=True, rope_theta=500000.0),
    # meta-llama/Llama-3.1-8B (its rope scaling left out): built packed (PACKED_SHAPES)
    "llama-3.1-8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=False, rope_theta=500000.0),
}
# Shapes whose float32 checkpoint would not fit in memory (32 GB at 8B): their mlx-lm directory is written
# packed, 4-bit with bfloat16 scales, from random integers (benchmarks/packed_checkpoint.py); there are no float
# weights, so llama.cpp (whose GGUF is written from them) is not measured on them.
PACKED_SHAPES = ("llama-3.1-8b",)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class CheckpointSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    dtype: str = "float32"
    seed: int = 0
    # A wider init than transformers' 0.02 makes the random model's logits less flat, so greedy
    # argmaxes are rarely decided by rounding noise and engines can be compared token by token.
    initializer_range: float = 0.05
    max_position_embeddings: int = 4096
    architecture: str = "llama"
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")

    @property
    def name(self) -> str:
        # The first three fields' defaults keep the name every earlier cache used for the ~100M Llama.
        extra = (f"-{self.architecture}" if self.architecture != "llama" else "") + \
                ("-tied" if self.tie_word_embeddings else "") + \
                (f"-rope{self.rope_theta:g}" if self.rope_theta != 10000.0 else "")
        return (f"llama-v{self.vocab_size}-h{self.hidden_size}-i{self.intermediate_size}-l{self.num_hidden_layers}"
                f"-a{self.num_attention_heads}-kv{self.num_key_value_heads}-s{self.seed}"
                f"-r{self.initializer_range}-{self.dtype}{extra}")

    @property
    def parameters(self) -> int:
        """Parameter count (a tied head counted once), from the shape alone."""
        h, i, layers, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        kv = h // self.num_attention_heads * self.num_key_value_heads
        qkv_bias = h + 2 * kv if self.architecture == "qwen2" else 0
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h + qkv_bias
        return (1 if self.tie_word_embeddings else 2) * v * h + layers * per_layer + h


def _config(spec: CheckpointSpec):
    from transformers import LlamaConfig, Qwen2Config

    kind = {"llama": LlamaConfig, "qwen2": Qwen2Config}[spec.architecture]
    return kind(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
                num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
                max_position_embeddings=spec.max_position_embeddings, initializer_range=spec.initializer_range,
                tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=None, eos_token_id=None,
                pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta})


def save_tokenizer(vocab_size: int, directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0").save_pretrained(directory)


def save_shards(directory: Path, shards: list, fmt: str) -> None:
    """Write safetensors shards, each made by one of `shards` (callables returning name -> tensor) only when it is
    written, so a real-size checkpoint never holds more than one shard's tensors; then the index naming them all.
    `fmt`: the files' metadata format ("pt", or "mlx" for an mlx-lm directory)."""
    from safetensors.torch import save_file

    weight_map, total = {}, 0
    for n, make in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = make()
        save_file(tensors, str(directory / name), metadata={"format": fmt})
        weight_map.update({key: name for key in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def build(spec: CheckpointSpec, directory: Path) -> None:
    """Write the checkpoint: float32 weights drawn from `spec.seed`, then cast to `spec.dtype`.

    Every dtype variant of one size therefore holds the same weights up to rounding.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(_config(spec)).eval().to(DTYPES[spec.dtype])
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    del model
    # transformers 5 writes rope_theta inside rope_parameters only; mlx-lm 0.32 reads the top-level key (and
    # would otherwise assume its own default theta), so both are written.
    config_path = directory / "config.json"
    saved = json.loads(config_path.read_text())
    saved["rope_theta"] = spec.rope_theta
    config_path.write_text(json.dumps(saved, indent=2))
    save_tokenizer(spec.vocab_size, directory)
    (directory / "bench_spec.json").write_text(json.dumps(asdict(spec)))


def cached(spec: CheckpointSpec, cache_dir: Path) -> Path:
    """The checkpoint directory for `spec` under `cache_dir`, built on first use."""
    directory = Path(cache_dir) / spec.name
    marker = directory / "bench_spec.json"
    if not (marker.is_file() and json.loads(marker.read_text()) == asdict(spec)):
        build(spec, directory)
    return directory


def load_torch(directory: Path, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype], attn_implementation="eager").eval()


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Quantized "dtypes": the float32 checkpoint converted by mlx-lm's own converter, so that etmlx (through
# `etmlx export`'s mlx-lm import, no requantization) and mlx-lm run the same integers.
QUANTIZED = {"int4": 4, "int8": 8}
GROUP_SIZE = 64


# The float dtypes a quantized directory's other tensors (scales, biases, norms) may be cast to.
QUANTIZED_FLOAT_DTYPES = ("float32", "bfloat16")


def cached_quantized(float_dir: Path, scheme: str, cache_dir: Path, float_dtype: str = "float32") -> Path:
    """`mlx_lm.convert(float_dir, quantize=True, q_bits, q_group_size=64)` under `cache_dir`, converted once.

    float_dtype "bfloat16" is `mlx_lm.convert --dtype bfloat16`: the weights rounded to bfloat16 before they are
    quantized (as a bfloat16 checkpoint's are) and the scales, biases and norms kept in bfloat16, as published
    4-bit models carry them."""
    import contextlib
    import io
    import shutil

    from mlx_lm import convert

    if scheme not in QUANTIZED:
        raise ValueError(f"scheme must be one of {sorted(QUANTIZED)}, got {scheme!r}")
    if float_dtype not in QUANTIZED_FLOAT_DTYPES:
        raise ValueError(f"float dtype must be one of {', '.join(QUANTIZED_FLOAT_DTYPES)}, got {float_dtype!r}")
    cast = float_dtype != "float32"
    directory = Path(cache_dir) / (f"{Path(float_dir).name}-mlx-{scheme}-g{GROUP_SIZE}" + (f"-{float_dtype}" if cast else ""))
    marker = directory / "bench_source.json"
    source = {"float": (Path(float_dir) / "bench_spec.json").read_text(), "scheme": scheme, "group_size": GROUP_SIZE,
              **({"float_dtype": float_dtype} if cast else {})}
    if marker.is_file() and json.loads(marker.read_text()) == source:
        return directory
    if directory.exists():  # another source or an interrupted conversion; convert refuses existing paths
        shutil.rmtree(directory)
    with contextlib.redirect_stdout(io.StringIO()):  # its [INFO] lines would interleave with the report
        convert(str(float_dir), str(directory), quantize=True, q_bits=QUANTIZED[scheme], q_group_size=GROUP_SIZE,
                dtype=float_dtype if cast else None)
    marker.write_text(json.dumps(source))  # last: a directory without it is converted again
    return directory


def cached_bfloat16(float_dir: Path) -> Path:
    """The float32 checkpoint `float_dir` as a bfloat16 Hugging Face checkpoint (`<float_dir>-bfloat16`), as
    releases ship: each tensor read from the mapped file and cast alone, written in shards of at most SHARD_BYTES,
    so the conversion holds one shard, not the model."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    float_dir = Path(float_dir)
    directory = float_dir.parent / f"{float_dir.name}-bfloat16"
    marker = directory / "bench_source.json"
    source = {"float": (float_dir / "bench_spec.json").read_text(), "dtype": "bfloat16"}
    if marker.is_file() and json.loads(marker.read_text()) == source:
        return directory
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    shards, shard, size = [], {}, 0
    for path in sorted(float_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                shard[key] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
                size += shard[key].numel() * shard[key].element_size()
                if size >= SHARD_BYTES:
                    shards.append(_write_shard(directory, len(shards), shard, save_file))
                    shard, size = {}, 0
    if shard:
        shards.append(_write_shard(directory, len(shards), shard, save_file))
    names = {}
    for n, keys in enumerate(shards):
        final = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        (directory / f"part-{n}.safetensors").rename(directory / final)
        names.update({key: final for key in keys})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    config = json.loads((float_dir / "config.json").read_text())
    config.update(torch_dtype="bfloat16", dtype="bfloat16")
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for name in float_dir.iterdir():
        if name.suffix != ".safetensors" and name.name not in ("config.json", "model.safetensors.index.json") \
                and name.is_file():
            shutil.copy(name, directory / name.name)
    marker.write_text(json.dumps(source))  # last: a directory without it is converted again
    return directory


SHARD_BYTES = 1 << 30


def _write_shard(directory: Path, n: int, shard: dict, save_file) -> list:
    save_file(shard, str(directory / f"part-{n}.safetensors"), metadata={"format": "pt"})
    return list(shard)
