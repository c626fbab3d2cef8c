"""A LoRA adapter directory read into one form: for each adapted layer, A [r, in], B [out, r] and the scale,
so that the layer's update is scale * B @ A.

Two layouts are read. mlx-lm's (`mlx_lm.lora` writes it): `adapters.safetensors` with `NAME.lora_a` [in, r]
and `NAME.lora_b` [r, out] per layer, NAME the layer's path in the model, and `adapter_config.json` whose
"lora_parameters" give "rank" and "scale" (mlx-lm's forward adds scale * (x @ lora_a) @ lora_b). PEFT's
(`save_pretrained` of a LoRA PeftModel): `adapter_model.safetensors` with
`base_model.model.NAME.lora_A.weight` [r, in] and `...lora_B.weight` [out, r], and `adapter_config.json`
whose "r" and "lora_alpha" (or their per-layer "rank_pattern" / "alpha_pattern" entries) give the scale
alpha / r (alpha / sqrt(r) with "use_rslora"). What either format can hold beyond plain LoRA on linear layers
(DoRA, full fine-tunes, trained biases, modules saved whole, embedding LoRA) is refused by name.

Every refusal is one ValueError starting with "adapter DIR:" (the CLI turns "adapter" into --adapter).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

MLX_LM_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
_FLOATS = {torch.float32, torch.float16, torch.bfloat16}


@dataclass(frozen=True)
class LoraUpdate:
    """One layer's low-rank update: scale * b @ a, a [r, in] and b [out, r]."""

    module: str  # the layer's path in the transformers model, e.g. model.layers.0.self_attn.q_proj
    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class Adapter:
    path: Path
    format: str  # "mlx-lm" or "peft"
    updates: tuple[LoraUpdate, ...]

    def describe(self) -> str:
        ranks = sorted({u.rank for u in self.updates})
        return (f"{self.format} LoRA adapter {self.path.name} ({len(self.updates)} layers, rank "
                f"{'/'.join(map(str, ranks))})")


def read_adapter(path: str | Path) -> Adapter:
    """The adapter in directory `path`, mlx-lm's or PEFT's layout (whichever weights file it holds)."""
    path = Path(path)
    where = f"adapter {path}:"
    if not path.is_dir():
        raise ValueError(f"{where} not a directory (give the directory holding {CONFIG} and the adapter weights)")
    has_mlx, has_peft = (path / MLX_LM_WEIGHTS).is_file(), (path / PEFT_WEIGHTS).is_file()
    if not has_mlx and not has_peft:
        raise ValueError(f"{where} holds neither {MLX_LM_WEIGHTS} (mlx-lm) nor {PEFT_WEIGHTS} (PEFT)")
    if has_mlx and has_peft:
        raise ValueError(f"{where} holds both {MLX_LM_WEIGHTS} and {PEFT_WEIGHTS}: keep the one to apply")
    config_path = path / CONFIG
    if not config_path.is_file():
        raise ValueError(f"{where} has no {CONFIG} (its rank and scale are there)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{where} {CONFIG} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where} {CONFIG} is not a JSON object")
    weights_file = path / (MLX_LM_WEIGHTS if has_mlx else PEFT_WEIGHTS)
    tensors = _read_tensors(weights_file, where)
    updates = _mlx_lm_updates(config, tensors, where) if has_mlx else _peft_updates(config, tensors, where)
    if not updates:
        raise ValueError(f"{where} {weights_file.name} holds no LoRA weights")
    return Adapter(path, "mlx-lm" if has_mlx else "peft", tuple(updates))


def _read_tensors(file: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{where} {file.name} is not a readable safetensors file ({exc})") from None


def _pairs(tensors: dict, a_suffix: str, b_suffix: str, where: str) -> dict[str, tuple]:
    """{layer: (A tensor, B tensor)} for names LAYER + suffix; a name with neither suffix, or half a pair,
    is refused."""
    pairs: dict[str, list] = {}
    for name, tensor in tensors.items():
        for slot, suffix in enumerate((a_suffix, b_suffix)):
            if name.endswith(suffix):
                pairs.setdefault(name[: -len(suffix)], [None, None])[slot] = tensor
                break
        else:
            raise ValueError(f"{where} tensor {name} is not a LoRA {a_suffix.strip('.')}/{b_suffix.strip('.')} "
                             "weight (only LoRA on linear layers is supported)")
    for layer, (a, b) in pairs.items():
        if a is None or b is None:
            missing = a_suffix if a is None else b_suffix
            raise ValueError(f"{where} {layer} has no {missing.strip('.')} weight")
        if a.dim() != 2 or b.dim() != 2 or not {a.dtype, b.dtype} <= _FLOATS:
            raise ValueError(f"{where} {layer}'s LoRA weights must be 2-d float32, float16 or bfloat16 tensors, got "
                             f"{a.dtype} {list(a.shape)} and {b.dtype} {list(b.shape)}")
    return {layer: tuple(ab) for layer, ab in sorted(pairs.items())}


def _rank_checked(layer: str, a: torch.Tensor, b: torch.Tensor, rank, where: str) -> None:
    """a [r, in], b [out, r]: both r equal to each other and to the config's rank."""
    if a.shape[0] != b.shape[1]:
        raise ValueError(f"{where} {layer}: rank mismatch between its A {list(a.shape)} and B {list(b.shape)}")
    if a.shape[0] != rank:
        raise ValueError(f"{where} {layer}: rank mismatch: its weights have rank {a.shape[0]}, {CONFIG} says {rank}")


def _mlx_lm_updates(config: dict, tensors: dict, where: str) -> list[LoraUpdate]:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ValueError(f"{where} fine_tune_type {kind!r} is not supported (only 'lora')")
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or not isinstance(params.get("rank"), int) or \
            not isinstance(params.get("scale"), (int, float)):
        raise ValueError(f"{where} {CONFIG} needs lora_parameters with an integer rank and a numeric scale")
    updates = []
    for layer, (a, b) in _pairs(tensors, ".lora_a", ".lora_b", where).items():
        a, b = a.t(), b.t()  # mlx-lm's x @ lora_a @ lora_b: A = lora_a^T, B = lora_b^T
        _rank_checked(layer, a, b, params["rank"], where)
        updates.append(LoraUpdate(layer, a, b, float(params["scale"])))
    return updates


# PEFT options that change what the adapter does beyond scale * B @ A on linear layers: (key, value meaning off).
_PEFT_OFF = (("use_dora", False), ("lora_bias", False), ("modules_to_save", None), ("layer_replication", None),
             ("trainable_token_indices", None), ("target_parameters", None), ("use_qalora", False),
             ("alora_invocation_tokens", None))


def _peft_updates(config: dict, tensors: dict, where: str) -> list[LoraUpdate]:
    kind = config.get("peft_type")
    if kind != "LORA":
        raise ValueError(f"{where} peft_type {kind!r} is not supported (only 'LORA')")
    for key, off in _PEFT_OFF:
        if config.get(key, off) not in (off, [], {}):
            raise ValueError(f"{where} {key}={config[key]!r} is not supported (plain LoRA on linear layers only)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where} bias={config['bias']!r} is not supported (trained biases; only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where} {CONFIG} needs an integer r and a numeric lora_alpha")
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    updates = []
    prefix = "base_model.model."
    for layer, (a, b) in _pairs(tensors, ".lora_A.weight", ".lora_B.weight", where).items():
        module = layer.removeprefix(prefix).removesuffix(".default")
        r, layer_alpha = _pattern(ranks, module, rank), _pattern(alphas, module, alpha)
        _rank_checked(module, a, b, r, where)
        updates.append(LoraUpdate(module, a, b, layer_alpha / (math.sqrt(r) if rslora else r)))
    return updates


def _pattern(patterns: dict, module: str, default):
    """PEFT's per-layer override: the first pattern that matches the end of the module's name, as PEFT's
    get_pattern_key matches it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
