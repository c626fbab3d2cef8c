"""`etmlx bench gpu-kit --out DIR`: everything a GPU host needs to measure etmlx there, made here.

A GPU host (a CUDA machine lent for minutes, a Mac) may have no torch 2.13 or ExecuTorch Python, so no
exporter: this writes the programs, their inputs and a manifest into DIR, and `benchmarks/gpu_device.py`
(numpy + mlx + mlx-lm only, no etmlx import) runs them there with the C++ tools (`etmlx_bench`,
`etmlx_decode`, each once per device through ETMLX_DEVICE=gpu|cpu) against mlx-lm on the same device:

  decoder   the ~100M Llama of `etmlx bench decode` (benchmarks/checkpoints.py BENCH_SIZE), 4-bit by
            `mlx_lm.convert -q` (group 64): the etmlx .pte (its mlx-lm import, the same integers) and the
            mlx-lm directory itself, so greedy tokens can be compared across engines and devices; and the
            same weights exported with --draft-tokens 8, which `etmlx_bench --drafts` times as Predicted
            Outputs (its own greedy continuation) and without drafts, against the plain program
  sampler   sampler-only programs (temperature; top-k 50 + top-p 0.9; top-p 0.9) at T=0.8 over LM-shaped
            logits (benchmarks/sampler_features.py), with each input's bytes (`etmlx_bench --inputs`), and the
            one-read-of-the-logits program as the floor

The manifest (`manifest.json`) lists each item with the settings both sides use.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from benchmarks import decode_programs as programs
from benchmarks.decode_shapes import export_in_child
from benchmarks.gpu_binaries import copy_binaries
from benchmarks.sampler_features import CONFIGS, TEMPERATURE, make_logits
from benchmarks.timing import ReadOnce
from benchmarks import checkpoints as ckpt

MAX_SEQ_LEN = 256
PROMPT_LEN = 64
DECODE_STEPS = 64
DRAFT_TOKENS = 8  # the speculative program's K (issue 21's Predicted Outputs target is at K = 8)
SAMPLER_SHAPES = ((151936, 1), (32000, 8))  # (vocabulary, batch): Qwen2.5's vocabulary; a batch of rows


def _decoder_items(out: Path, cache_dir: Path, size: dict, log) -> list[dict]:
    spec = ckpt.CheckpointSpec(**size)
    float_dir = ckpt.cached(spec, cache_dir)
    mlx_dir = ckpt.cached_quantized(float_dir, "int4", cache_dir)
    pte = programs.cached_pte(mlx_dir, "etmlx", MAX_SEQ_LEN)
    export_in_child(mlx_dir, pte, MAX_SEQ_LEN, log)
    shutil.copyfile(pte, out / "decoder-int4.pte")
    spec_pte = programs.cached_pte(mlx_dir, f"spec-k{DRAFT_TOKENS}", MAX_SEQ_LEN)
    export_in_child(mlx_dir, spec_pte, MAX_SEQ_LEN, log, extra=["--draft-tokens", str(DRAFT_TOKENS)])
    shutil.copyfile(spec_pte, out / f"decoder-int4-spec-k{DRAFT_TOKENS}.pte")
    target = out / "decoder-int4-mlx"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(mlx_dir, target, ignore=shutil.ignore_patterns("bench_*.json", "*.pte", "*.export.json"))
    prompt = torch.randint(0, spec.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    return [{"kind": "decoder", "name": "decoder-int4", "pte": "decoder-int4.pte", "mlx_lm_dir": "decoder-int4-mlx",
             "parameters": spec.parameters, "prompt_ids": prompt, "decode_steps": DECODE_STEPS,
             "sampled": {"temperature": 0.8, "seed": 7}, "speculative": f"decoder-int4-spec-k{DRAFT_TOKENS}.pte",
             "draft_tokens": DRAFT_TOKENS}]


def _shape_item(shape: str, out: Path, cache_dir: Path, log) -> dict:
    """A published model's shape (checkpoints.SHAPES), 4-bit: the etmlx .pte only (a real-size mlx-lm
    directory would double what travels), so mlx-lm runs the same config with its own random 4-bit weights
    there: a speed comparison, no token comparison."""
    if shape in ckpt.PACKED_SHAPES:  # its float32 checkpoint would not fit in memory
        raise ValueError(f"--shape {shape} is built packed for `etmlx bench decode --shape` only; this benchmark "
                         "needs its float checkpoint")
    fields = dict(ckpt.SHAPES[shape])
    spec = ckpt.CheckpointSpec(**fields)
    mlx_dir = ckpt.cached_quantized(ckpt.cached(spec, cache_dir), "int4", cache_dir)
    pte = programs.cached_pte(mlx_dir, "etmlx", MAX_SEQ_LEN)
    export_in_child(mlx_dir, pte, MAX_SEQ_LEN, log)
    name = f"{shape}-int4"
    shutil.copyfile(pte, out / f"{name}.pte")
    prompt = torch.randint(0, spec.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    return {"kind": "decoder", "name": name, "pte": f"{name}.pte",
            "mlx_lm_config": json.loads((mlx_dir / "config.json").read_text()), "parameters": spec.parameters,
            "prompt_ids": prompt, "decode_steps": DECODE_STEPS, "sampled": {"temperature": 0.8, "seed": 7}}


def _write_inputs(directory: Path, inputs: list[torch.Tensor]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i, tensor in enumerate(inputs):
        (directory / f"input_{i}.bin").write_bytes(tensor.contiguous().numpy().tobytes())


def _sampler_items(out: Path, shapes) -> list[dict]:
    from backends.mlx.exporter.export import export_to_pte
    from backends.mlx.llm.sampler.config import SamplerConfig
    from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head, sampler_inputs

    items = []
    for vocab, batch in shapes:
        logits = make_logits("lm", batch, vocab)
        logits_file = f"logits-v{vocab}-b{batch}.npy"
        np.save(out / logits_file, logits.numpy())
        reader = f"read-v{vocab}-b{batch}"
        (out / f"{reader}.pte").write_bytes(export_to_pte(ReadOnce(), (torch.zeros(batch, vocab),)).pte)
        _write_inputs(out / f"{reader}-inputs", [logits])
        for name, knobs in CONFIGS.items():
            config = SamplerConfig(top_k="top_k" in knobs, top_p="top_p" in knobs)
            stem = f"sampler-{name}-v{vocab}-b{batch}"
            (out / f"{stem}.pte").write_bytes(
                export_sampling_head(LogitsInput(), (torch.zeros(batch, vocab),), config=config).pte)
            tensors = {"top_k": torch.tensor(knobs.get("top_k", 0)), "top_p": torch.tensor(knobs.get("top_p", 1.0))}
            _write_inputs(out / f"{stem}-inputs", sampler_inputs(
                config, [logits], torch.tensor(TEMPERATURE), torch.tensor(11),
                **{k: v for k, v in tensors.items() if k in config.knob_names()}))
            items.append({"kind": "sampler", "name": stem, "pte": f"{stem}.pte", "inputs": f"{stem}-inputs",
                          "reader": f"{reader}.pte", "reader_inputs": f"{reader}-inputs", "logits": logits_file,
                          "vocab": vocab, "batch": batch, "temperature": TEMPERATURE,
                          "top_k": knobs.get("top_k", 0), "top_p": knobs.get("top_p", 0.0)})
    return items


def build(out: Path, cache_dir: Path = Path("out/bench"), log=print, size: dict = ckpt.BENCH_SIZE,
          sampler_shapes=SAMPLER_SHAPES, shapes=(), binaries: bool = False) -> Path:
    """size, sampler_shapes: smaller ones make a kit in seconds (the tests); shapes: names of
    checkpoints.SHAPES to add as real-size decoders; binaries: the C++ tools, their libraries,
    gpu_device.py and gpu_host_arrays.py go into the kit too (benchmarks/gpu_binaries.py), so the GPU host needs only it and MLX's wheel."""
    out.mkdir(parents=True, exist_ok=True)
    if binaries:  # first: a missing build fails before minutes of exports
        copied = copy_binaries(out / "bin")
        for script in ("gpu_device.py", "gpu_host_arrays.py"):
            shutil.copy2(Path(__file__).with_name(script), out / script)
        log(f"gpu kit: {len(copied)} binaries and libraries in {out / 'bin'}")
    items = _decoder_items(out, cache_dir, size, log) + [_shape_item(s, out, cache_dir, log) for s in shapes] \
        + _sampler_items(out, sampler_shapes)
    manifest = out / "manifest.json"
    manifest.write_text(json.dumps({"items": items}, indent=1))
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    if binaries:
        how = (f"LD_LIBRARY_PATH={out}/bin:<site-packages>/mlx/lib python3 {out}/gpu_device.py {out} --bin {out}/bin "
               "(after `pip install` of the GPU's mlx wheel and mlx-lm)")
    else:
        how = f"python3 benchmarks/gpu_device.py {out} --bin DIR_WITH_etmlx_bench"
    log(f"gpu kit: {len(items)} items, {total / 1e6:.1f} MB in {out}; run there: {how}")
    return manifest
