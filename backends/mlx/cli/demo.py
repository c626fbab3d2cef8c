"""`etmlx demo`: the built-in language model end to end, offline.

Trains (once, cached) the small Llama checkpoint of `llm/builtin_model.py` on the corpus shipped with
the repo, exports it with its KV cache and sampler to one .pte (again only when the checkpoint changed),
then generates on the device: greedy, checked token for token against transformers, and sampled.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from backends.mlx.llm.builtin.model import DEFAULT_RECIPE, ensure_builtin_checkpoint
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.meta import has_embedded_meta
from backends.mlx.llm.decoder.prompt import encode_prompt
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.llm.decoder.text_stream import IncrementalDetokenizer

DEFAULT_PROMPT = "One morning, Mira went to"
STAMP = "etmlx_builtin.json"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _export_if_stale(ckpt: Path, pte: Path, max_seq_len: int) -> None:
    stamp = ckpt / STAMP
    if pte.is_file() and has_embedded_meta(pte) and pte.stat().st_mtime > stamp.stat().st_mtime:
        print(f"using {pte} (exported from the current checkpoint)")
        return
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager")
    result = export_decoder(model, pte, max_seq_len, config=SamplerConfig(top_k=True, top_p=True, min_p=True),
                            tokenizer=ckpt, progress=lambda stage: _say(f"  export: {stage}"))
    print(f"exported {ckpt.name} to {pte} ({len(result.pte) / 1e6:.1f} MB) in {time.perf_counter() - start:.0f}s: "
          f"{result.summary()}")


def _stream(decoder: Decoder, prompt_ids, max_tokens: int, params: SamplingParams):
    detok = IncrementalDetokenizer(decoder.tokenizer, prompt_ids)
    start = time.perf_counter()
    tokens, first = [], None
    for step in decoder.stream(prompt_ids, max_tokens, params):
        first = first or time.perf_counter()
        tokens.append(step.token)
        print(detok.add(step.token), end="", flush=True)
    print(detok.flush())
    end = time.perf_counter()
    rate = (len(tokens) - 1) / (end - first) if len(tokens) > 1 else 0.0
    print(f"  [{len(tokens)} tokens; time to first token {(first - start) * 1e3:.0f} ms; decode {rate:.0f} tok/s]")
    return tokens


def main(out: Path, prompt: str = DEFAULT_PROMPT, max_tokens: int = 60, cache_dir: Path | None = None,
         recipe=DEFAULT_RECIPE, max_seq_len: int = 256) -> int:
    out = Path(out)
    cache_dir = Path(cache_dir) if cache_dir else out.parent / "cache"
    _say(f"built-in checkpoint: {cache_dir} (trained once on backends/mlx/llm/builtin/data/corpus.txt, then cached)")
    ckpt = ensure_builtin_checkpoint(cache_dir, recipe)
    _export_if_stale(ckpt, out, max_seq_len)
    decoder = Decoder(out)
    prompt_ids = encode_prompt(decoder.tokenizer, prompt)
    print(f"\ngreedy, on the device: {prompt}", end="")
    greedy = _stream(decoder, prompt_ids, max_tokens, SamplingParams())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                                   pad_token_id=0)[0, len(prompt_ids):].tolist()
    same = reference[:len(greedy)] == greedy
    print(f"  same tokens as transformers greedy generation: {same}")
    print(f"\nsampled (temperature 0.8, top-p 0.95, seed 7): {prompt}", end="")
    _stream(decoder, prompt_ids, max_tokens, SamplingParams(temperature=0.8, top_p=0.95, seed=7))
    return 0 if same else 1
