"""The `etmlx export`, `etmlx generate` and `etmlx chat` parsers, and export itself (generate and chat run in
generate_command.py and chat_command.py, which never import the exporter)."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from backends.mlx.cli.draft_flags import add_draft_flags
from backends.mlx.cli.knob_flags import add_knob_arguments, params_from_args
from backends.mlx.llm.decoder.from_checkpoint import DEFAULT_SAMPLER as DEFAULT_FEATURES
from backends.mlx.llm.decoder.from_checkpoint import SAMPLER_CHOICES as FEATURES
from backends.mlx.llm.decoder.tool_formats import FORMATS as TOOL_FORMATS

# export_checkpoint's options that are flags here: its messages name the option, the CLI says the flag.
_EXPORT_OPTIONS = ("dtype", "quantize", "logprobs", "draft_tokens", "propose_tokens", "out", "sampler", "adapter",
                   "tensor_parallel", "pipeline_parallel", "adapters")


def _progress():
    start = time.perf_counter()

    def say(stage: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {stage}", file=sys.stderr, flush=True)

    return say


def _as_flags(message: str) -> str:
    """'draft_tokens must be ...' -> '--draft-tokens must be ...': the leading option name, and the names with an
    underscore (never English words) anywhere after it ('... with kv_bits' -> '... with --kv-bits')."""
    option = message.split(" ", 1)[0].removesuffix(":")  # "adapters: ..." too
    if option in _EXPORT_OPTIONS:
        message = "--" + option.replace("_", "-") + message[len(option):]
    names = "|".join(name for name in (*_EXPORT_OPTIONS, "kv_bits", "kv_scale_dtype") if "_" in name)
    return re.sub(rf"(?<![\w-])({names})\b", lambda m: "--" + m.group(1).replace("_", "-"), message)


def run_export(args) -> int:
    from backends.mlx.llm.decoder.from_checkpoint import export_checkpoint

    try:
        result = export_checkpoint(
            args.model, args.out, revision=args.revision, dtype=args.dtype, quantize=args.quantize,
            group_size=args.group_size, quantize_embeddings=args.quantize_embeddings, max_seq_len=args.max_seq_len,
            batch=args.batch, sampler=args.sampler, logprobs=args.logprobs, logprobs_mode=args.logprobs_mode,
            seeded=args.seeded, pipelined=args.pipelined, verify=args.verify, draft_tokens=args.draft_tokens,
            propose_tokens=args.propose_tokens, external_weights=args.external_weights, progress=_progress(),
            adapter=args.adapter, tool_call_format=args.tool_call_format,
            qmm_activations=args.qmm_activations, kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
            kv_scale_dtype=args.kv_scale_dtype, tensor_parallel=args.tensor_parallel,
            pipeline_parallel=args.pipeline_parallel, adapters=_adapters(args.adapters))
    except (ValueError, IsADirectoryError) as exc:  # the option names of the Python API, as this command's flags
        raise type(exc)(_as_flags(str(exc))) from None
    from backends.mlx.exporter.export import weights_path
    from backends.mlx.llm.checkpoint_source import default_pte_name

    out = Path(args.out or default_pte_name(args.model))
    written = f"{out} ({out.stat().st_size / 1e6:.1f} MB)"
    ptd = weights_path(out)
    if args.external_weights and ptd.is_file():
        written += f" and {ptd} ({ptd.stat().st_size / 1e6:.1f} MB)"
    ranks = max(args.tensor_parallel, args.pipeline_parallel)
    if ranks > 1:
        written += f" and {ranks - 1} more rank file(s) beside it ({out.stem}.rankR{out.suffix})"
    print(f"wrote {written}: {result.summary()}")
    return 0


def _adapters(spec: str | None) -> dict | None:
    from backends.mlx.llm.lora.switchable import parse_adapters

    return parse_adapters(spec) if spec is not None else None


def _text_flags(parser, max_tokens: int) -> None:
    """What generate and chat share besides the knobs (cli/knob_flags.py); short names as mlx_lm.generate spells them."""
    parser.add_argument("pte", nargs="?", help="a .pte written by `etmlx export`")
    parser.add_argument("--model", help="the .pte, as mlx_lm names it (instead of the positional argument)")
    parser.add_argument("-m", "--max-tokens", type=int, default=max_tokens, help=f"default {max_tokens}")
    # mlx-lm's spelling of --temperature; SUPPRESS keeps --temperature's default
    parser.add_argument("--temp", dest="temperature", type=float, default=argparse.SUPPRESS,
                        help="the same as --temperature")
    parser.add_argument("--system-prompt", help="system message for the chat template")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--image", action="append", default=[], metavar="PATH",
                        help="an image for a vision-language program (repeatable), placed before the (first) "
                             "message's text")
    parser.add_argument("--adapter-name", metavar="NAME", help="run on this switchable LoRA adapter of the program "
                        "(exported with --adapters NAME=DIR,...; `etmlx inspect` lists them); default: the base model")


def _rank_flags(parser) -> None:
    """An N-rank (tensor- or pipeline-parallel) program's run (docs/distributed.md)."""
    parser.add_argument("--hostfile", metavar="FILE", help="an N-rank program: MLX's ring hostfile (JSON, "
                        "one list of \"ip:port\" per rank) or mlx.launch's naming only this machine, for the ranks "
                        "started here (other machines: run under mlx.launch); default: free loopback ports")
    parser.add_argument("--starting-port", type=int, default=32323, metavar="P",
                        help="an N-rank program with mlx.launch's hostfile: the ring's first port, counting up per "
                             "rank and ip as mlx.launch does (default 32323)")
    parser.add_argument("--rank-timeout", type=float, default=120.0, metavar="S",
                        help="an N-rank program: end the run when no rank progresses for S seconds "
                             "(default 120)")


def run_generate(args) -> int:
    from backends.mlx.cli.generate_command import run_generate as run

    return run(args, params_from_args(args))


def run_chat(args) -> int:
    from backends.mlx.cli.chat_command import run_chat as run

    return run(args, params_from_args(args))


def add_parsers(sub) -> None:
    export = sub.add_parser("export", help="export a local Hugging Face causal LM (Llama, Mistral, Qwen2/3, GPT-2) "
                                           "with its KV cache and sampler to one .pte")
    export.add_argument("--model", required=True, help="a Hugging Face checkpoint: a local directory, or a repo "
                                                       "id (Qwen/Qwen2.5-0.5B-Instruct) fetched into the HF cache")
    export.add_argument("--revision", help="with a repo id: the branch, tag or commit to fetch (default: main)")
    export.add_argument("--out", help="the .pte to write (it holds the tokenizer and metadata too); default: "
                                      "NAME.pte in the current directory, NAME the repo's or directory's")
    export.add_argument("--dtype", default="float32", help="weights and cache: float32 (default), float16, bfloat16")
    export.add_argument("--quantize", help="int4 or int8: quantize the linear layers with MLX's affine scheme "
                                           "(what mlx_lm.convert -q writes); an mlx-lm quantized checkpoint needs "
                                           "no flag")
    export.add_argument("--group-size", type=int, default=64, help="--quantize: input channels per scale and "
                                                                    "bias, 32, 64 (default) or 128")
    export.add_argument("--quantize-embeddings", action=argparse.BooleanOptionalAction, default=True,
                        help="--quantize: the token embedding and the head too (default on)")
    export.add_argument("--qmm-activations", choices=["int16", "int8", "float32"], default="int16",
                        help="quantized linears on the CPU: the activations rounded per group to 16-bit integers "
                             "(default), to 8-bit (faster, other tokens; --verify may then refuse the program) or "
                             "kept float32; recorded in the program")
    export.add_argument("--external-weights", action="store_true",
                        help="write the weights to FILE.ptd beside FILE.pte (ExecuTorch's external data file); "
                             "generate, serve and etmlx_decode load it from there (etmlx_decode --weights too)")
    export.add_argument("--max-seq-len", type=int, default=256, help="KV cache length (default 256)")
    export.add_argument("--kv-bits", type=int, choices=[8, 4], default=0,
                        help="store the KV cache MLX-affine quantized to 8 or 4 bits (as mlx-lm's --kv-bits), "
                             "attention over it in the program (default: float, the --dtype)")
    export.add_argument("--kv-group-size", type=int, default=64,
                        help="--kv-bits: head-dimension values per scale and bias, 32, 64 (default) or 128")
    export.add_argument("--kv-scale-dtype", choices=["float32", "float16", "bfloat16"], default="",
                        help="--kv-bits: the dtype of the cache's scales and biases (default: bfloat16 for a "
                             "float32 model, 0.9x its cache bytes at 4 bits; else the --dtype)")
    export.add_argument("--batch", type=int, default=1, help="rows per call (default 1; a server uses more)")
    seeding = export.add_mutually_exclusive_group()
    seeding.add_argument("--seeded", dest="seeded", action="store_true", default=True,
                         help="the program takes a seed input: reproducible sampling (default)")
    seeding.add_argument("--unseeded", dest="seeded", action="store_false",
                         help="no seed input: draws from MLX's global random state")
    pipelining = export.add_mutually_exclusive_group()
    pipelining.add_argument("--pipeline", dest="pipelined", action="store_true", default=None,
                            help="each call returns the previous call's token, so the host never waits for the step "
                                 "it just started (default, except with the mask feature)")
    pipelining.add_argument("--no-pipeline", dest="pipelined", action="store_false",
                            help="each call returns its own token (default with --sampler ...,mask: structured "
                                 "output needs each token before the next step)")
    export.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                        help="after writing, run the program and check its greedy tokens (and logprobs) against the "
                             "eager model on a short prompt; a mismatch removes the file and fails (default on)")
    export.add_argument("--sampler", default=DEFAULT_FEATURES,
                        help=f"sampler features compiled in, comma-separated from {', '.join(FEATURES)} "
                             f"(default {DEFAULT_FEATURES}); their values are runtime inputs")
    export.add_argument("--logprobs", type=int, default=0, help="also return the chosen token's logprob and the "
                                                                 "top-N alternatives (default 0: off)")
    export.add_argument("--logprobs-mode", choices=["raw", "processed"], default="raw",
                        help="raw: the model's distribution (default); processed: after bias, temperature, filters")
    export.add_argument("--draft-tokens", type=int, default=0, metavar="K",
                        help="a program that verifies up to K drafted tokens per call (speculative decoding: "
                             "greedy acceptance, rejection sampling at T > 0; pipelined, its calls without drafts "
                             "do not wait for their token); default 0: a plain program")
    export.add_argument("--propose-tokens", type=int, default=0, metavar="K",
                        help="a draft model's program: each call returns K tokens (the plain token and the K - 1 "
                             "greedy steps after it), so a --draft-model proposal is one call; plain sampler, "
                             "unpipelined; default 0: one token per call")
    export.add_argument("--adapter", metavar="DIR", help="a LoRA adapter directory (mlx-lm's adapters.safetensors or "
                        "PEFT's adapter_model.safetensors, with adapter_config.json) fused into the weights")
    export.add_argument("--adapters", metavar="NAME=DIR,...", help="LoRA adapters kept unfused beside the base "
                        "weights, each request choosing one by name (generate/chat --adapter-name, the server's "
                        "model BASE:NAME) or none; names: letters, digits, '.', '_', '-'")
    export.add_argument("--tool-call-format", choices=TOOL_FORMATS, default=None,
                        help="the call syntax of tool calls (default: detected from the chat template; generic for a "
                             "template without tools)")
    export.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="split the model over N ranks (processes or devices; docs/distributed.md): one file per "
                             "rank, OUT.pte for rank 0 and OUT.rankR.pte; `etmlx generate OUT.pte` starts the ranks")
    export.add_argument("--pipeline-parallel", type=int, default=1, metavar="N",
                        help="split the model's layers over N ranks, a contiguous block each (rank 0 also the "
                             "embedding, the last the head; docs/distributed.md): files as --tensor-parallel's")
    export.set_defaults(func=run_export)

    generate = sub.add_parser("generate", help="decode on the device from an exported .pte, streaming text")
    _text_flags(generate, max_tokens=64)
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("-p", "--prompt", help="prompt text, '-' reads stdin (uses the tokenizer exported with "
                                               "the .pte; through its chat template unless --ignore-chat-template)")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids, used as they are")
    generate.add_argument("--ignore-chat-template", action="store_true",
                          help="tokenize the prompt as raw text instead of as a user message")
    add_knob_arguments(generate)
    generate.add_argument("--json", action="store_true", help="print token ids, text, logprobs and timings as JSON")
    generate.add_argument("--prefill-step-size", type=int, default=None, metavar="N",
                          help="prompt tokens per prefill call (default 512; 0: the whole prompt in one call)")
    structured = generate.add_mutually_exclusive_group()  # needs a program exported with --sampler ...,mask
    structured.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid for this JSON schema")
    structured.add_argument("--regex", metavar="R", help="the output matches this regular expression")
    structured.add_argument("--choice", metavar="A,B,C", help="the output is one of these comma-separated strings")
    structured.add_argument("--grammar", metavar="FILE", help="the output matches this Lark or GBNF grammar")
    add_draft_flags(generate, prediction=True)  # --draft-tokens programs decode speculatively: same tokens
    _rank_flags(generate)
    generate.set_defaults(func=run_generate)

    chat = sub.add_parser("chat", help="a multi-turn conversation with an exported .pte (lines from stdin, replies "
                                       "streamed; /reset, /exit)")
    _text_flags(chat, max_tokens=256)
    add_knob_arguments(chat)
    add_draft_flags(chat, prediction=False)
    chat.add_argument("--prompt-cache", metavar="FILE", help="keep the conversation (messages and KV cache) in FILE: "
                      "resumed from it when it exists, saved after each reply")
    chat.add_argument("--tools", metavar="FILE", help="a JSON file of OpenAI tools ([{\"type\": \"function\", "
                      "\"function\": {name, description, parameters}}]): the model may call them; each call is shown "
                      "and its result read from stdin, or from --tool-exec")
    chat.add_argument("--tool-choice", default="auto", metavar="MODE",
                      help="auto (default), required, none, or a function's name (the first answer of each turn)")
    chat.add_argument("--tool-exec", metavar="COMMAND", help="runs each call: the call as JSON ({\"name\", "
                      "\"arguments\"}) on its stdin, its stdout the result")
    chat.set_defaults(func=run_chat)
