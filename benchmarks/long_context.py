"""`etmlx bench decode --shape NAME --context 1k,8k,32k [--kv-bits 4] [--layers N] [--vocab V]`: long prompts.

A random model of the shape (benchmarks/checkpoints.py SHAPES), its linears quantized to
int4 (group 64, as mlx_lm.convert -q), exported once with max_seq_len = the longest context + the decode steps,
KV cache float (the model dtype) or --kv-bits 8/4 (llm/decoder/kv_quant.py). Per context, a fresh child process
loads the program, prefills the prompt in chunks of PREFILL_CHUNK tokens (the program's calls at their own start
positions: one call over 32k tokens would hold [heads, 32k, 32k] scores), then decodes STEPS greedy tokens, and
reports prefill and decode tok/s, its RSS after loading and after decoding, and its peak RSS. `--score-limit MB`
sets the runtime's bound on one attention's scores (runtime/attention_limit.py; default 64 MiB): a chunk's
attention over a long context runs in blocks of query rows within it, and a huge limit measures it unblocked.

Memory against the cache: the program's KV buffers (what its state holds, [rows, heads, positions, .] each) are
allocated whole on the first call, so RSS growth from load to the end of the decode is compared with their bytes;
the rest of the growth is the prefill's working set. The full shape at 32k is beyond this 2-core host's time, so
`--layers N` builds N of the shape's layers and the report extrapolates: cache bytes per layer (exact: the
buffers), times the shape's layer count, plus the measured non-cache growth.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

PREFILL_CHUNK = 512
STEPS = 16


def parse_contexts(text: str) -> list[int]:
    """'1k,8k,32k' -> [1024, 8192, 32768]; ValueError (one line) for anything else."""
    out = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        scale = 1024 if part.endswith("k") else 1
        digits = part[:-1] if part.endswith("k") else part
        if not digits.isdigit() or int(digits) < 1:
            raise ValueError(f"--context takes token counts like 1k,8k,32k or 2048, got {part!r}")
        out.append(int(digits) * scale)
    if not out:
        raise ValueError("--context needs at least one length")
    return out


def _shape(name: str) -> dict:
    from benchmarks.checkpoints import SHAPES

    shapes = SHAPES
    if name not in shapes:
        raise ValueError(f"unknown shape {name!r} (one of {', '.join(sorted(shapes))})")
    return dict(shapes[name])


def _program(shape: dict, layers: int, vocab: int, kv_bits: int, max_seq_len: int, dtype: str, out: Path,
             kv_group: int = 64) -> Path:
    """The int4 program of `layers` of the shape's layers, exported once per setting under `out`."""
    group = f"g{kv_group}" if kv_bits and kv_group != 64 else ""
    name = (f"long-{shape['hidden_size']}-l{layers}-v{vocab}-kv{kv_bits}{group}-{dtype}-n{max_seq_len}.pte")
    pte = out / name
    if pte.is_file():
        return pte
    from transformers import LlamaConfig, Qwen2Config

    from backends.mlx.llm.decoder.export import export_decoder
    from backends.mlx.llm.quantize.affine import quantize_model

    kind = {"llama": LlamaConfig, "qwen2": Qwen2Config}[shape["architecture"]]
    config = kind(vocab_size=vocab, hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                  num_hidden_layers=layers, num_attention_heads=shape["num_attention_heads"],
                  num_key_value_heads=shape["num_key_value_heads"], max_position_embeddings=max_seq_len,
                  tie_word_embeddings=shape["tie_word_embeddings"], bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, initializer_range=0.05,
                  rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]})
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval().to(getattr(torch, dtype))
    quantize_model(model, 4, 64)
    out.mkdir(parents=True, exist_ok=True)
    export_decoder(model, pte, max_seq_len, pipelined=False, verify=False, kv_bits=kv_bits,
                   **({"kv_group_size": kv_group} if kv_bits else {}))
    return pte


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(pte: str, context: str, score_limit: str) -> None:
    """One context in a fresh process: one JSON line of timings and memory."""
    from backends.mlx.runtime import attention_limit

    with attention_limit.score_limit_set(int(score_limit)):
        _measure(pte, context)


def _measure(pte: str, context: str) -> None:
    from backends.mlx.llm.decoder.loop import Decoder
    from backends.mlx.llm.decoder.step_inputs import step_inputs
    from backends.mlx.llm.sampler.params import SamplingParams

    decoder = Decoder(Path(pte))
    meta, execute = decoder.meta, decoder.method.execute
    loaded = _rss_bytes("VmRSS")
    cache = sum(b.shape[0] * b.shape[1] * b.shape[2] * b.shape[3] * torch.empty(0, dtype=b.dtype).element_size()
                for b in decoder.method.state.buffers)
    n = int(context)
    prompt = torch.randint(0, meta.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    params = [SamplingParams()]

    def call(tokens: torch.Tensor, start: int) -> int:
        inputs = step_inputs(meta, tokens.view(1, -1), [start], [tokens.numel()], params, [0], [start == 0])
        return int(execute(inputs)[0][0])  # the token: reading it waits for the call

    begin = time.perf_counter()
    for start in range(0, n, PREFILL_CHUNK):
        token = call(prompt[start:start + PREFILL_CHUNK], start)
    prefill = time.perf_counter() - begin
    begin = time.perf_counter()
    for step in range(STEPS):
        token = call(torch.tensor([token]), n + step)
    decode = time.perf_counter() - begin
    print(json.dumps({"context": n, "prefill_tok_s": n / prefill, "decode_tok_s": STEPS / decode,
                      "rss_loaded": loaded, "rss_end": _rss_bytes("VmRSS"), "peak_rss": _rss_bytes("VmHWM"),
                      "cache_bytes": cache}))


def main(shape_name: str, contexts: list[int], kv_bits: int, layers: int | None, vocab: int | None,
         dtype: str, cache_dir: Path, json_path: str | None, score_limit_mb: float | None = None,
         kv_group: int = 64) -> int:
    from backends.mlx.runtime.attention_limit import DEFAULT_SCORE_LIMIT

    if score_limit_mb is not None and score_limit_mb <= 0:
        raise ValueError(f"--score-limit takes a positive number of MB, got {score_limit_mb}")
    score_limit = int(score_limit_mb * 2**20) if score_limit_mb else DEFAULT_SCORE_LIMIT
    shape = _shape(shape_name)
    layers = layers or shape["num_hidden_layers"]
    vocab = vocab or shape["vocab_size"]
    pte = _program(shape, layers, vocab, kv_bits, max(contexts) + STEPS, dtype, Path(cache_dir) / "long_context",
                   kv_group)
    kv = f"{kv_bits}-bit (group {kv_group}, {dtype} scales)" if kv_bits else f"float ({dtype})"
    print(f"{shape_name}: {layers} of {shape['num_hidden_layers']} layers, vocab {vocab}, int4 weights, {dtype} "
          f"activations, KV cache {kv}, max_seq_len {max(contexts) + STEPS}; prefill in chunks of {PREFILL_CHUNK}, "
          f"{STEPS} decode steps; attention scores within {score_limit / 2**20:g} MiB; program "
          f"{pte.stat().st_size / 1e6:.0f} MB")
    print(f"{'context':>8} {'prefill tok/s':>14} {'decode tok/s':>13} {'RSS load':>9} {'RSS end':>9} "
          f"{'peak':>9} {'growth':>9} {'KV cache':>9}")
    records = []
    for n in contexts:
        ran = subprocess.run([sys.executable, "-m", "benchmarks.long_context", str(pte), str(n), str(score_limit)],
                             capture_output=True, text=True)
        if ran.returncode != 0:
            raise RuntimeError(f"context {n}: the child failed:\n{ran.stderr[-3000:]}")
        r = json.loads(ran.stdout.strip().splitlines()[-1])
        r["growth"] = r["rss_end"] - r["rss_loaded"]
        records.append(r)
        mb = lambda b: f"{b / 2**20:8.0f}M"  # noqa: E731
        print(f"{n:>8} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.2f} {mb(r['rss_loaded'])} "
              f"{mb(r['rss_end'])} {mb(r['peak_rss'])} {mb(r['growth'])} {mb(r['cache_bytes'])}", flush=True)
    last = records[-1]
    per_layer = last["cache_bytes"] / layers
    full = per_layer * shape["num_hidden_layers"]
    other = last["growth"] - last["cache_bytes"]
    print(f"KV cache per layer at {max(contexts) + STEPS} positions: {per_layer / 2**20:.1f} MiB (the program's "
          f"buffers); x {shape['num_hidden_layers']} layers = {full / 1e9:.2f} GB; growth beyond the cache at "
          f"{last['context']} tokens: {other / 1e6:.0f} MB; the full shape's extrapolated growth: "
          f"{(full + other) / 1e9:.2f} GB over its weights (the issue's target: <= 1.3 GB)")
    if json_path:
        Path(json_path).write_text(json.dumps({"shape": shape_name, "layers": layers, "vocab": vocab,
                                               "kv_bits": kv_bits, "kv_group_size": kv_group, "dtype": dtype,
                                               "score_limit": score_limit,
                                               "records": records,
                                               "extrapolated_growth_bytes": full + other}, indent=2))
    return 0


if __name__ == "__main__":
    _child(*sys.argv[1:])
