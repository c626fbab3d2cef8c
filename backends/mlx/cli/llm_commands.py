"""`etmlx export` and `etmlx generate`: a causal LM to one decoder .pte, and the decode loop over it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from backends.mlx.cli.knob_flags import add_knob_arguments, params_from_args
from backends.mlx.llm.sampler.knobs import FEATURE_FLAGS, parse_features

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}
FEATURES = (*FEATURE_FLAGS, "none")
DEFAULT_FEATURES = "top-k,top-p,min-p"


def sampler_config(features: str, logprobs: int, logprobs_mode: str):
    from backends.mlx.llm.sampler.config import SamplerConfig

    if logprobs < 0:
        raise ValueError(f"--logprobs must be >= 0, got {logprobs}")
    return SamplerConfig(**parse_features(features), logprobs=logprobs, logprobs_mode=logprobs_mode)


def _progress():
    start = time.perf_counter()

    def say(stage: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {stage}", file=sys.stderr, flush=True)

    return say


def run_export(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.mlx.llm.decoder.export import export_decoder

    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of float32, float16, bfloat16, got {args.dtype!r}")
    config = sampler_config(args.sampler, args.logprobs, args.logprobs_mode)
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"--model {args.model} is not a local checkpoint directory (nothing is downloaded)")
    say = _progress()
    say(f"loading {model_dir} as {DTYPES[args.dtype]}")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, DTYPES[args.dtype]),
                                                 attn_implementation="eager")
    tokenizer = None
    if any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    else:
        say("no tokenizer in the checkpoint: generate will need --prompt-ids")
    result = export_decoder(model, Path(args.out), args.max_seq_len, config=config, batch=args.batch,
                            seeded=args.seeded, tokenizer=tokenizer, progress=say)
    say("done")
    print(f"wrote {args.out} ({len(result.pte) / 1e6:.1f} MB): {result.summary()}")
    return 0


def _prompt_ids(args, decoder) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    ids = decoder.tokenizer(args.prompt, add_special_tokens=True)["input_ids"]
    return list(ids)


def run_generate(args) -> int:
    from backends.mlx.llm.decoder.loop import Decoder
    from backends.mlx.llm.decoder.text_stream import IncrementalDetokenizer, StopStrings

    params = params_from_args(args)  # bad values fail before the program loads
    decoder = Decoder(Path(args.pte))
    prompt = _prompt_ids(args, decoder)
    stops = StopStrings(args.stop)
    if args.stop and not decoder.has_tokenizer:
        decoder.tokenizer  # raises, naming the missing tokenizer: stop strings need text
    detok = IncrementalDetokenizer(decoder.tokenizer, prompt) if decoder.has_tokenizer else None
    tokens, logprobs, tops, text = [], [], [], []
    finish = "length"
    start = time.perf_counter()
    first = None
    for step in decoder.stream(prompt, args.max_tokens, params):
        if first is None:
            first = time.perf_counter()
        tokens.append(step.token)
        if step.logprob is not None:
            logprobs.append(step.logprob)
            tops.append(step.top)
        if step.token in decoder.meta.eos_token_ids:
            finish = "stop"
            break
        piece = stops.feed(detok.add(step.token)) if detok else f"{step.token} "
        text.append(piece)
        if not args.json:
            print(piece, end="", flush=True)
        if stops.stopped:
            finish = "stop"
            break
    end = time.perf_counter()
    if detok and not stops.stopped:
        tail = stops.feed(detok.flush()) + stops.flush()
        text.append(tail)
        if not args.json:
            print(tail, end="")
    ttft = (first or end) - start
    decode_tps = (len(tokens) - 1) / (end - first) if first and len(tokens) > 1 and end > first else 0.0
    report = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens), "finish_reason": finish,
              "time_to_first_token_s": round(ttft, 6), "prefill_tokens_per_s": round(len(prompt) / ttft, 2),
              "decode_tokens_per_s": round(decode_tps, 2)}
    if args.json:
        out = {"tokens": tokens, **report}
        if detok:
            out["text"] = "".join(text)
        if decoder.meta.config.logprobs:
            out["logprobs"] = logprobs
            out["top_logprobs"] = [[{"id": i, "logprob": v} for i, v in top] for top in tops]
        print(json.dumps(out))
    else:
        print()
        print(f"[{len(prompt)} prompt tokens, {len(tokens)} generated, finish: {finish}; "
              f"time to first token {ttft * 1000:.1f} ms, decode {decode_tps:.1f} tok/s]", file=sys.stderr)
    return 0


def add_parsers(sub) -> None:
    export = sub.add_parser("export", help="export a local Hugging Face causal LM (Llama, Mistral, Qwen2/3, GPT-2) "
                                           "with its KV cache and sampler to one .pte")
    export.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    export.add_argument("--out", required=True, help="the .pte to write (FILE.pte.json and FILE.pte.tokenizer/ "
                                                     "are written beside it)")
    export.add_argument("--dtype", default="float32", help="weights and cache: float32 (default), float16, bfloat16")
    export.add_argument("--max-seq-len", type=int, default=256, help="KV cache length (default 256)")
    export.add_argument("--batch", type=int, default=1, help="rows per call (default 1; a server uses more)")
    seeding = export.add_mutually_exclusive_group()
    seeding.add_argument("--seeded", dest="seeded", action="store_true", default=True,
                         help="the program takes a seed input: reproducible sampling (default)")
    seeding.add_argument("--unseeded", dest="seeded", action="store_false",
                         help="no seed input: draws from MLX's global random state")
    export.add_argument("--sampler", default=DEFAULT_FEATURES,
                        help=f"sampler features compiled in, comma-separated from {', '.join(FEATURES)} "
                             f"(default {DEFAULT_FEATURES}); their values are runtime inputs")
    export.add_argument("--logprobs", type=int, default=0, help="also return the chosen token's logprob and the "
                                                                 "top-N alternatives (default 0: off)")
    export.add_argument("--logprobs-mode", choices=["raw", "processed"], default="raw",
                        help="raw: the model's distribution (default); processed: after bias, temperature, filters")
    export.set_defaults(func=run_export)

    generate = sub.add_parser("generate", help="decode on the device from an exported .pte, streaming text")
    generate.add_argument("pte", help="a .pte written by `etmlx export`")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (uses the tokenizer exported with the .pte)")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    generate.add_argument("--max-tokens", type=int, default=64)
    add_knob_arguments(generate)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--json", action="store_true", help="print token ids, text, logprobs and timings as JSON")
    generate.set_defaults(func=run_generate)
