"""`etmlx bench prompt-cache`: what the prompt cache (runtime/decode_rows.h) saves, on the built-in model.

- chat: a 6-turn conversation through the chat template, as `etmlx chat` runs it: time to first token of
  each turn with the cache (only the new turn is prefilled) and without (the whole conversation again).
- shared prefix: 16 requests whose prompts share a 1,500-token prefix (the built-in corpus) and end in
  distinct questions, through the server's engine: prompt tokens prefilled vs unique prompt tokens (the
  prefix once plus each request's own part), and wall time. Once with requests arriving one after
  another, once with all 16 submitted together (a request copies the prefix from the row that holds it:
  cross-row reuse, decode_rows.py), once together with step_cost_tokens=0 (prefix affinity always
  waits), and once together without copies (rows share no KV entries: the engine's prefix affinity
  decides between waiting for the row that holds the prefix to end and prefilling it on a free row).

- file: the 1,500-token prefix as a conversation saved with etmlx.save_prompt_cache and loaded into a freshly
  loaded program: file size, save and load time, and the next turn's time to first token after loading vs the
  whole conversation prefilled by another freshly loaded program (medians over the repetitions).

The built-in checkpoint (trained once, cached in `cache_dir/builtin-llama`) was trained on 256-token
windows with 512 positions; the program here has 2,048 (the RoPE positions are computed, not learned), so
text past 512 tokens is not meaningful: this measures work and time, not quality.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

from backends.mlx.llm.builtin.corpus import generate_corpus
from backends.mlx.llm.builtin.model import STAMP, ensure_builtin_checkpoint
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.prompt import chat_prompt, encode_prompt
from backends.mlx.llm.decoder.decode_rows import common_prefix
from backends.mlx.llm.decoder.text_generation import stream_text
from backends.mlx.llm.sampler.params import SamplingParams

MAX_SEQ_LEN = 2048
BATCH = 4
TURNS = ["Tell me about Mira.", "Where does she live?", "What did she find at the market?",
         "Who did she meet there?", "What happened the next morning?", "How does the story end?"]
PREFIX_TOKENS = 1500
REQUESTS = 16


def _program(cache_dir: Path) -> Path:
    ckpt = ensure_builtin_checkpoint(cache_dir)
    pte = cache_dir / f"builtin-prompt-cache-{MAX_SEQ_LEN}.pte"
    if pte.is_file() and pte.stat().st_mtime > (ckpt / STAMP).stat().st_mtime:
        return pte
    from transformers import AutoModelForCausalLM

    from backends.mlx.llm.decoder.export import export_decoder

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager")
    model.config.max_position_embeddings = MAX_SEQ_LEN  # see the module docstring
    export_decoder(model, pte, MAX_SEQ_LEN, batch=BATCH, tokenizer=ckpt, verify=False)
    return pte


def chat(decoder: Decoder, reuse: bool, max_tokens: int, tag: str) -> list[dict]:
    """Per turn: prompt tokens, tokens prefilled, time to first token. `tag` starts every user message, so
    that conversations of different repetitions share no more than the template's first tokens."""
    tokenizer, messages, turns = decoder.tokenizer, [], []
    params = SamplingParams()
    for text in TURNS:
        messages.append({"role": "user", "content": f"{tag} {text}"})
        prompt = chat_prompt(tokenizer, messages)
        start = time.perf_counter()
        first, reply = None, []
        for response in stream_text(decoder, prompt, max_tokens, params, (), tokenizer, reuse=reuse):
            first = first or time.perf_counter() - start
            reply.append(response.text)
        turns.append({"prompt_tokens": len(prompt), "prefilled": len(prompt) - decoder.last_cached,
                      "ttft_s": first})
        messages.append({"role": "assistant", "content": "".join(reply)})
    return turns


class _NoCopies:
    """A loaded method without its state access: the engine's rows share no KV entries (no cross-row reuse)."""

    def __init__(self, method):
        self.execute = method.execute


def shared_prefix(pte: Path, decoder: Decoder, together: bool, max_tokens: int, step_cost_tokens=None,
                  copies: bool = True) -> dict:
    from backends.mlx.runtime.runner import load_method
    from backends.mlx.serve.engine import Engine, EngineRequest

    tokenizer = decoder.tokenizer
    prefix = encode_prompt(tokenizer, generate_corpus())[:PREFIX_TOKENS]
    suffixes = [tokenizer.encode(f" Question {i}: who is {name}?", add_special_tokens=False)
                for i, name in enumerate(["Mira", "the baker", "the fox", "the old man"] * (REQUESTS // 4))]
    prompts = [prefix + s for s in suffixes]
    options = {} if step_cost_tokens is None else {"step_cost_tokens": step_cost_tokens}
    method = load_method(pte)
    engine = Engine(method if copies else _NoCopies(method), decoder.meta, **options).start()
    done = threading.Semaphore(0)
    requests = [EngineRequest(p, SamplingParams(), max_tokens,
                              lambda e: done.release() if e.finish_reason else None) for p in prompts]
    start = time.perf_counter()
    try:
        if together:
            engine.submit_all(requests)
            for _ in requests:
                done.acquire()
        else:
            for request in requests:
                engine.submit(request)
                done.acquire()
    finally:
        engine.stop()
    seconds = time.perf_counter() - start
    prefilled = sum(len(r.prompt) - r.cached_tokens for r in requests)
    unique = _trie_size(prompts)
    arrivals = "together" if together else "one after another"
    if step_cost_tokens is not None:
        arrivals += f", step_cost_tokens={step_cost_tokens}"
    if not copies:
        arrivals += ", no cross-row copies"
    return {"arrivals": arrivals, "requests": len(requests),
            "prompt_tokens": sum(len(p) for p in prompts), "prefilled": prefilled, "unique": unique,
            "prefilled_over_unique": prefilled / unique, "seconds": seconds}


def saved_conversation(pte: Path, directory: Path, repeats: int) -> dict:
    import etmlx

    model = etmlx.load(pte)
    prefix = encode_prompt(model.tokenizer, generate_corpus())[:PREFIX_TOKENS]
    question = model.tokenizer.encode(" Question: who is Mira?", add_special_tokens=False)
    cache = etmlx.make_prompt_cache(model)
    etmlx.generate(model, prefix, 8, prompt_cache=cache)
    path = directory / "bench-conversation.safetensors"
    times = {"save_s": [], "load_s": [], "ttft_loaded_s": [], "ttft_fresh_s": []}
    cached = 0
    for _ in range(repeats + 1):  # the first round warms up each program's shapes; dropped
        start = time.perf_counter()
        etmlx.save_prompt_cache(path, cache)
        save = time.perf_counter() - start
        restored_model = etmlx.load(pte)
        start = time.perf_counter()
        restored = etmlx.load_prompt_cache(path, restored_model)
        load = time.perf_counter() - start
        start = time.perf_counter()
        first = next(iter(etmlx.stream_generate(restored_model, question, 2, prompt_cache=restored)))
        ttft_loaded = time.perf_counter() - start
        cached = first.cached_tokens
        fresh = etmlx.load(pte)  # as freshly loaded as restored_model: the whole conversation prefilled
        start = time.perf_counter()
        next(iter(etmlx.stream_generate(fresh, restored.tokens + question, 2)))
        ttft_fresh = time.perf_counter() - start
        for key, value in zip(times, (save, load, ttft_loaded, ttft_fresh)):
            times[key].append(value)
    result = {key: statistics.median(values[1:]) for key, values in times.items()}
    result.update({"tokens": len(cache.tokens), "cached_after_load": cached, "file_bytes": path.stat().st_size})
    path.unlink()
    return result


def _trie_size(prompts: list[list[int]]) -> int:
    """Distinct token prefixes among the prompts: the tokens a perfect prefix cache computes once."""
    ordered = sorted(prompts)
    return sum(len(p) - (common_prefix(p, q) if q else 0) for p, q in zip(ordered, [None] + ordered[:-1]))


def _median_turns(runs: list[list[dict]]) -> list[dict]:
    return [{**turns[0], "ttft_s": statistics.median(t["ttft_s"] for t in turns)} for turns in zip(*runs)]


def main(cache_dir: str | Path, json_path: str | None = None, max_tokens: int = 16, repeats: int = 3) -> int:
    """Chat times are medians over `repeats` conversations."""
    cache_dir = Path(cache_dir)
    pte = _program(cache_dir)
    result = {"program": str(pte), "chat": {}, "shared_prefix": []}
    decoder = Decoder(pte)
    chat(decoder, True, max_tokens, "[warm-up]")  # first calls of each shape
    runs = {True: [], False: []}
    for repetition in range(repeats):  # interleaved, so that load from elsewhere hits both alike
        for reuse in (True, False):
            runs[reuse].append(chat(decoder, reuse, max_tokens, f"[{repetition}/{reuse}]"))
    for reuse in (True, False):
        turns = _median_turns(runs[reuse])
        key = "cached" if reuse else "uncached"
        result["chat"][key] = turns
        print(f"chat ({key}): " + "  ".join(f"turn {i + 1}: {t['prompt_tokens']} tok, prefilled {t['prefilled']}, "
                                            f"TTFT {t['ttft_s'] * 1e3:.1f} ms" for i, t in enumerate(turns)))
        print(f"  turn 6 / turn 1 TTFT: {turns[-1]['ttft_s'] / turns[0]['ttft_s']:.2f}x")
    decoder = Decoder(pte)
    # together, step_cost_tokens=0: every request waits for the row holding the prefix (compute-optimal)
    for together, cost, copies in ((False, None, True), (True, None, True), (True, 0, True), (True, None, False)):
        record = shared_prefix(pte, decoder, together, max_tokens, cost, copies)
        result["shared_prefix"].append(record)
        print(f"shared {PREFIX_TOKENS}-token prefix, {record['requests']} requests, {record['arrivals']}: "
              f"prefilled {record['prefilled']} of {record['prompt_tokens']} prompt tokens, unique "
              f"{record['unique']}: {record['prefilled_over_unique']:.2f}x unique, {record['seconds']:.1f} s")
    saved = result["file"] = saved_conversation(pte, cache_dir, repeats)
    print(f"file: {saved['tokens']} tokens in {saved['file_bytes'] / 1e6:.2f} MB, save {saved['save_s'] * 1e3:.0f} ms, "
          f"load {saved['load_s'] * 1e3:.0f} ms; next turn after loading: {saved['cached_after_load']} tokens reused, "
          f"TTFT {saved['ttft_loaded_s'] * 1e3:.0f} ms vs {saved['ttft_fresh_s'] * 1e3:.0f} ms prefilled fresh")
    result["chat_turn6_over_turn1"] = {k: v[-1]["ttft_s"] / v[0]["ttft_s"] for k, v in result["chat"].items()}
    result["median_ttft_s"] = {k: statistics.median(t["ttft_s"] for t in v) for k, v in result["chat"].items()}
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    return 0
