"""The two .pte files `etmlx bench decode` compares, exported once and cached.

  etmlx    `export_decoder`: model, KV cache and sampler in the etmlx delegate (returns token ids)
  xnnpack  the same `StaticCacheLM` returning the logits at each row's last token, lowered with ExecuTorch's
           XnnpackPartitioner (what it cannot take, e.g. the cache writes, runs on ExecuTorch's CPU
           kernels); the caller samples on the host

Exporting the ~100M model takes minutes, so a program is cached under the checkpoint's directory,
keyed by a fingerprint of everything that shapes it: the Python sources of `backends/mlx` (the
lowering and serialization), the executorch version and the cache length.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

_PACKAGE = Path(__file__).resolve().parents[1] / "backends" / "mlx"
# Command-line front ends and the modules that only load native libraries (the package
# __init__, blas_route, runtime) do not shape a program; every other module might.
_NOT_SHAPING = {"cli", "serve", "tools", "inspect_pte.py", "__init__.py", "blas_route.py", "runtime"}


def source_fingerprint() -> str:
    import executorch.version

    digest = hashlib.sha256(executorch.version.__version__.encode())
    for path in sorted(_PACKAGE.rglob("*.py")):
        relative = path.relative_to(_PACKAGE)
        if _NOT_SHAPING & set(relative.parts):
            continue
        digest.update(str(relative).encode())
        digest.update(path.read_bytes())
    digest.update(Path(__file__).read_bytes())  # how this file exports
    return digest.hexdigest()[:12]


def cached_pte(checkpoint: Path, engine: str, max_seq_len: int) -> Path:
    return Path(checkpoint) / f"{engine}-s{max_seq_len}-{source_fingerprint()}.pte"


def cached_versions(pte: Path) -> list[Path]:
    """Every file beside `pte` (a cached_pte path) that an export of the same engine wrote: its .pte of any length
    or sources, and the files named after it."""
    engine = pte.name.rsplit("-", 2)[0]  # "{engine}-s{max_seq_len}-{fingerprint}.pte"
    return sorted(pte.parent.glob(f"{engine}-s*-*.pte*"))


def export_xnnpack(model: torch.nn.Module, out: Path, max_seq_len: int) -> tuple[int, dict]:
    """Lower (tokens [1, L], start_pos [1], lengths [1]) -> logits [1, V] with XNNPACK.

    Returns (delegate calls, ops left outside the delegate)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from backends.mlx.exporter.export import count_outside
    from backends.mlx.llm.decoder.kv_cache import StaticCacheLM

    module = StaticCacheLM(model.eval(), max_seq_len=max_seq_len).eval()
    length = torch.export.Dim("length", min=1, max=max_seq_len)
    # As for the etmlx decoder: the example is as long as the cache, which sizes the dynamic input's buffer.
    example = (torch.ones(1, max_seq_len, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
               torch.full((1,), max_seq_len, dtype=torch.int64))
    with torch.no_grad():
        exported = torch.export.export(module, example, dynamic_shapes=({1: length}, None, None))
    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    calls, outside = count_outside(edge.exported_program())
    Path(out).write_bytes(edge.to_executorch().buffer)
    return calls, dict(outside)


def export_etmlx(model: torch.nn.Module, out: Path, max_seq_len: int, tokenizer_dir: Path):
    """The decoder program `etmlx export` writes by default (temperature sampler, seeded), with its
    metadata and tokenizer inside."""
    from backends.mlx.llm.decoder.export import export_decoder

    return export_decoder(model, Path(out), max_seq_len, tokenizer=tokenizer_dir)


def load_model(checkpoint: Path, dtype: str) -> torch.nn.Module:
    """The torch model to export: a float checkpoint as `dtype`, or (int4/int8) the mlx-lm quantized
    checkpoint as `etmlx export --model MLX_LM_DIR` loads it, packed integers as they are, float32
    activations (the dtype mlx-lm converted the float32 checkpoint's scales to)."""
    from benchmarks import checkpoints as ckpt

    if dtype in ckpt.QUANTIZED:
        from backends.mlx.llm.quantize.mlx_checkpoint import load_mlx_quantized

        return load_mlx_quantized(checkpoint, torch.float32)
    return ckpt.load_torch(checkpoint, dtype)
