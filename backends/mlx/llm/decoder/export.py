"""Export a causal LM (model, KV cache and sampler) to one decoder .pte for on-device decoding.

The program's inputs (names and order recorded in the metadata the .pte embeds, see meta.py):
  tokens [B, L] int64     L is dynamic, 1..max_seq_len: one program prefills and decodes
  start_pos [B] int64     cache position of tokens[:, 0], per row
  lengths [B] int64       real tokens per row (1..L); the next token is sampled at index lengths-1
  temperature [B]         then seed [B] (seeded programs) and the knobs of the SamplerConfig, per row
Outputs: token ids [B] (and logprobs when exported with them); a pipelined program returns the
previous call's and takes -1 for "the token you sampled last" (pipelined.py).
With draft_tokens=K (`--draft-tokens K`) the program verifies drafts instead (speculative_head.py): a
verify [B, G] input follows lengths (the last accepted token and the drafts per row), and it returns (accepted [B], token [B]);
pipelined (the default without the allowed mask), it also takes deliver [B] bool after verify and returns fed [B]
(pipelined_verify.py).
With propose_tokens=K (`--propose-tokens K`, a draft model's program: proposer.py) a call returns tokens [B, K]:
the plain token and the K - 1 greedy (or seed + i) steps after it, in one call; unpipelined, plain sampler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from backends.mlx.exporter.export import ExportResult, export_to_pte, weights_path
from backends.mlx.exporter.plain_step import PlainStep
from backends.mlx.llm.decoder.adapter_input import AdapterInput
from backends.mlx.llm.decoder.meta import (ADAPTER_INPUT, IMAGE_INPUT, META_KEY, PROCESSOR_PREFIX, ROPE_INPUT,
                                           TOKENIZER_PREFIX, DecoderMeta)
from backends.mlx.llm.decoder.tool_formats import check_format, detect_format
from backends.mlx.llm.decoder.tokenizer_files import as_tokenizer, prompt_affixes, tokenizer_blobs
from backends.mlx.llm.sampler.export import knob_examples
from backends.mlx.llm.decoder.kv_cache import StaticCacheLM
from backends.mlx.llm.decoder.kv_quant import kv_quant
from backends.mlx.llm.decoder.kv_reference import KvCacheReference
from backends.mlx.llm.decoder.model_support import float_dtype, text_config
from backends.mlx.llm.decoder.qwen2_vl import MropeInputs, uses_mrope
from backends.mlx.llm.vision.preprocess import pixel_steps
from backends.mlx.llm.decoder.vision_export import (image_prompt, image_text, processor_config, vision_data,
                                                    vision_encoder, vision_spec)
from backends.mlx.llm.decoder.pipelined import FedBackSteps
from backends.mlx.llm.decoder.pipelined_verify import DeliveredOrFedBack
from backends.mlx.llm.decoder.proposer import ProposingHead, verify_proposer
from backends.mlx.llm.decoder.resident_pages import paged_out_after_use, release
from backends.mlx.llm.decoder.release_memory import collect_if_large
from backends.mlx.llm.decoder.speculative_head import DraftVerifyingHead
from backends.mlx.llm.decoder.speculative_verify import verify_draft_program
from backends.mlx.llm.decoder.verify import VerificationError, VerificationReport, verify_decoder
from backends.mlx.llm.decoder.verify_vision import verify_with_image
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.head import SamplingHead


def _eos_ids(model) -> list[int]:
    ids = []
    vocab = text_config(model.config).vocab_size
    for source in (getattr(model, "generation_config", None), model.config, text_config(model.config)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        for value in ([eos] if isinstance(eos, int) else list(eos or [])):
            if value not in ids and 0 <= value < vocab:
                ids.append(value)
    return ids


class ImageInputs(torch.nn.Module):
    """A vision-language decoder's model inputs: tokens, start_pos, lengths, image_embeds (positional, so the
    program takes them in that order, before the sampler's)."""

    def __init__(self, lm: StaticCacheLM):
        super().__init__()
        self.lm = lm

    def forward(self, tokens, start_pos, lengths, image_embeds):
        return self.lm(tokens, start_pos, lengths, image_embeds=image_embeds)


def export_decoder(model: torch.nn.Module, out: Path, max_seq_len: int, *, config: SamplerConfig | None = None,
                   batch: int = 1, seeded: bool = True, tokenizer=None,
                   progress: Optional[Callable[[str], None]] = None, external_weights: bool = False,
                   pipelined: bool | None = None, verify: bool = True, draft_tokens: int = 0,
                   propose_tokens: int = 0, tool_call_format: str | None = None,
                   qmm_activations: str = "int16", kv_bits: int = 0, kv_group_size: int = 64,
                   kv_scale_dtype: str = "", rank: tuple[int, int, str] | None = None,
                   processor_files: dict[str, bytes] | None = None, adapters=None) -> ExportResult:
    """Write `out` (.pte) holding the program, its DecoderMeta and, given one (a transformers tokenizer or
    a directory holding one), the tokenizer: the one file is all a decode loop needs. `external_weights`:
    the weights go to `out` with suffix .ptd instead (the runners load it from beside the .pte).
    `pipelined` (pipelined.py; default: unless the sampler has the allowed-mask input): each call returns
    the previous call's outputs, so a loop overlaps its host work with the device's step.
    `verify`: run the written program in the runtime and check it decodes as `model` does (verify.py);
    on a mismatch the file is removed and VerificationError names the first divergent step.
    `draft_tokens` K > 0: a program that verifies up to K drafted tokens per call (speculative_head.py);
    pipelined, its calls without drafts need not wait for their outputs (pipelined_verify.py).
    `propose_tokens` K > 1: a draft model's program returning K tokens per call (proposer.py).
    `tool_call_format`: the call syntax of tool calls (tool_formats.py; default: detected from the chat template).
    `qmm_activations`: export_to_pte's (int16, int8 or float32 activations in the CPU's quantized products).
    `kv_bits` 4 or 8: the KV cache stored MLX-affine quantized in groups of `kv_group_size` (kv_quant.py), the
    scales and biases in `kv_scale_dtype` (default: bfloat16 for a float32 model, else the model's dtype); the
    check then runs against the eager model over the same quantized cache (kv_reference.py).
    `rank`: (rank, ranks, group id) when `model` is one rank's part of an N-rank program
    (llm/decoder/rank_programs.py, which verifies the ranks together: a rank cannot run alone).

    A vision-language model (vision_export.py) gets its vision method beside the decoder, and the decoder an
    image_embeds input; `processor_files` (file name -> bytes: its image processor's config) go into the program.

    `adapters`: the AttachedAdapters of switchable LoRA adapters already in `model` (llm/lora/switchable.py): the
    program takes the per-row `adapter` input after the model inputs (adapter_input.py)."""
    if tool_call_format:
        check_format(tool_call_format)  # before the export's minutes
    # 4 or 8 bits only in a program (2 is the eager reference's control)
    kv_quant(kv_bits, kv_group_size, kv_scale_dtype)
    config = config or SamplerConfig()
    if config.expose_counts:
        raise ValueError("expose_counts is for sampler tests, not decoder programs")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 0:
        raise ValueError(f"draft_tokens must be an int >= 0, got {draft_tokens!r}")
    if draft_tokens and pipelined and config.allowed_mask:
        raise ValueError("--draft-tokens with the allowed mask: a pipelined draft-verifying program cannot take "
                         "a mask (each step's mask depends on the token before it); drop --pipeline")
    if isinstance(propose_tokens, bool) or not isinstance(propose_tokens, int) or propose_tokens < 0:
        raise ValueError(f"propose_tokens must be an int >= 0, got {propose_tokens!r}")
    if propose_tokens:
        if draft_tokens:
            raise ValueError("--propose-tokens is a draft model's program and --draft-tokens a target's: "
                             "export them as two programs")
        if pipelined:
            raise ValueError("--propose-tokens programs are unpipelined (a proposal is needed at once): "
                             "drop --pipeline")
        if propose_tokens >= max_seq_len:
            raise ValueError(f"--propose-tokens {propose_tokens} must be below max_seq_len {max_seq_len}")
        pipelined = False
    if adapters is not None and (draft_tokens or propose_tokens):
        raise ValueError("adapters: switchable adapters need a plain program (not --draft-tokens or --propose-tokens)")
    if draft_tokens >= max_seq_len:
        raise ValueError(f"--draft-tokens {draft_tokens} must be below max_seq_len {max_seq_len}")
    model = model.eval()
    processor = processor_config(processor_files)
    encoder = vision_encoder(model, processor)
    if encoder is not None:
        if draft_tokens or propose_tokens:
            raise ValueError("--draft-tokens / --propose-tokens: not supported for vision-language programs")
        if not processor_files:
            raise ValueError("a vision-language checkpoint needs its image processor's config "
                             "(processor_config.json or preprocessor_config.json) to export")
        if kv_bits:
            raise ValueError("--kv-bits: not supported for vision-language programs yet")
        if adapters is not None:
            raise ValueError("adapters: switchable adapters are not supported for vision-language programs yet")
    lm = StaticCacheLM(model, max_seq_len=max_seq_len, batch=batch, rings=not (draft_tokens or propose_tokens),
                       kv_bits=kv_bits, kv_group_size=kv_group_size, kv_scale_dtype=kv_scale_dtype)
    vocab = text_config(model.config).vocab_size
    if pipelined is None:
        pipelined = not config.allowed_mask
    if draft_tokens:
        head = DraftVerifyingHead(lm, config, batch=batch, vocab=vocab, draft_tokens=draft_tokens)
        program = DeliveredOrFedBack(head, batch) if pipelined else head
    else:
        inputs = (MropeInputs(lm) if uses_mrope(model.config) else ImageInputs(lm)) if encoder is not None else lm
        head = SamplingHead(inputs, config, batch=batch, vocab=vocab)
        program = FedBackSteps(head, config, batch) if pipelined else head
        if propose_tokens:
            program = ProposingHead(head, propose_tokens, max_seq_len)
    length = torch.export.Dim("length", min=1, max=max_seq_len)
    # The example is as long as the cache: ExecuTorch sizes a dynamic input's buffer from it.
    example = (torch.ones(batch, max_seq_len, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64),
               torch.full((batch,), max_seq_len, dtype=torch.int64))
    kwargs = {}
    if adapters is not None:  # before the head's keywords, as AdapterInput's signature orders them
        program = AdapterInput(program, adapters.choice)
        kwargs[ADAPTER_INPUT] = torch.zeros(batch, dtype=torch.int64)
    kwargs["temperature"] = torch.ones(batch)
    vision = vision_spec(model, encoder) if encoder is not None else None
    if seeded:
        kwargs["seed"] = torch.zeros(batch, dtype=torch.int64)
    examples = knob_examples(config, batch, per_row=True, vocab=vocab)
    kwargs.update({name: examples[name] for name in config.knob_names()})
    dynamic = {"args": ({1: length}, None, None), **{name: None for name in kwargs}}
    if vision is not None:  # [B, L, D]: the image embedding at each image-token position (kv_cache.py)
        example = example + (torch.zeros(batch, max_seq_len, vision[2]),)
        dynamic["args"] = dynamic["args"] + ({1: length},)
        if uses_mrope(model.config):  # [B, L, 3]: each token's rotary positions (qwen2_vl.py)
            example = example + (torch.zeros(batch, max_seq_len, 3, dtype=torch.int64),)
            dynamic["args"] = dynamic["args"] + ({1: length},)
    if draft_tokens:  # DraftVerifyingHead names its inputs (SamplingHead takes *args)
        example = example + (torch.zeros(batch, draft_tokens + 1, dtype=torch.int64),)
        # One row: G is dynamic (1..K+1), a call pays for the drafts it carries (none: one column, as a plain
        # step). More rows: B * G would be an expression of it, which the delegate does not take, so G is K + 1.
        width = torch.export.Dim("verify", min=1, max=draft_tokens + 1) if batch == 1 else None
        dynamic = {"tokens": {1: length}, "start_pos": None, "lengths": None,
                   "verify": {1: width} if width is not None else None,
                   **{name: None for name in kwargs}}
        if pipelined:  # DeliveredOrFedBack: deliver [B] bool after verify
            example = example + (torch.ones(batch, dtype=torch.bool),)
            dynamic["deliver"] = None  # torch.export matches dynamic shapes to inputs by name
        if config.allowed_mask:  # a mask per verified position: [B, G, words], G the verify input's
            kwargs["allowed_mask"] = kwargs["allowed_mask"].unsqueeze(1).expand(-1, draft_tokens + 1, -1).contiguous()
            dynamic["allowed_mask"] = {1: width} if width is not None else None
    tokenizer = as_tokenizer(tokenizer) if tokenizer is not None else None
    blobs = tokenizer_blobs(tokenizer) if tokenizer is not None else {}
    dtype = str(float_dtype(model)).replace("torch.", "")
    meta = DecoderMeta.build(max_seq_len=max_seq_len, vocab_size=vocab, batch=batch, eos_token_ids=_eos_ids(model),
                             seeded=seeded, config=config, dtype=dtype, model_type=getattr(model.config, "model_type", ""),
                             tokenizer=TOKENIZER_PREFIX if blobs else None,
                             prompt_affixes=prompt_affixes(tokenizer) if tokenizer is not None else ([], []),
                             pipelined=pipelined, draft_tokens=draft_tokens, propose_tokens=propose_tokens,
                             ring_cache=any(lm.ring_window(i) is not None for i in lm.layers), vision=vision,
                             adapters=adapters.names if adapters is not None else ())
    if vision is not None and uses_mrope(model.config):
        meta.inputs.insert(meta.inputs.index(IMAGE_INPUT) + 1, ROPE_INPUT)
    if kv_bits:
        meta.kv_bits, meta.kv_group_size = kv_bits, kv_group_size
    if encoder is not None:
        meta.image_text = image_text(model, tokenizer)
        meta.image_prompt = image_prompt(model, tokenizer, processor_files, vision[1])
        if not meta.image_prompt and len(vision[4]) == 3 and not uses_mrope(model.config):
            meta.pixel_steps = pixel_steps(processor or {})
    # the tool-call syntax: given, else the one the chat template teaches (tool_formats.detect_format)
    if rank is not None:
        meta.rank, meta.ranks = rank[0], rank[1]
    meta.tool_call_format = (tool_call_format if tool_call_format else
                             detect_format(getattr(tokenizer, "chat_template", None)) if tokenizer is not None else "")
    blobs[META_KEY] = meta.to_bytes()
    blobs.update({PROCESSOR_PREFIX + name: data for name, data in (processor_files or {}).items()})
    if encoder is not None:
        blobs.update(vision_data(model))
    methods = {vision[3]: (encoder, (torch.zeros(1, *vision[4]),))} if vision is not None else None
    # A one-row draft program's call without drafts (verify [1, 1]) runs the plain step stored beside it, the
    # plain program's graph over the same state (exporter/plain_step.py); with more rows verify is [B, K + 1].
    plain_step = (PlainStep(switch=lambda on: setattr(head, "plain_step", on), when="verify")
                  if draft_tokens and batch == 1 else None)
    result = export_to_pte(program, example, kwargs, dynamic_shapes=dynamic, progress=progress, named_data=blobs,
                           weights="external" if external_weights else "pte", plain_step=plain_step,
                           qmm_activations=qmm_activations, rank=rank,
                           methods=methods)
    result.save(Path(out))
    if verify:
        say = progress or (lambda _stage: None)
        # What only the export needed (the traced graphs; the wrapper's KV cache, 150 MB at 8B with 576
        # positions) goes before the check loads the written program on top of what this process holds.
        with_image = encoder is not None
        result.release_program()
        lm.release_caches()
        program = head = lm = inputs = plain_step = methods = encoder = None
        collect_if_large(model, give_back=True)
        # The eager model's weights mapped from the checkpoint are read again, page by page, by the reference
        # forward; meanwhile the runtime holds its own copy of them (resident_pages.py).
        release(model)
        say("verifying the program against the eager model")
        reference = KvCacheReference(model, kv_bits, kv_group_size, kv_scale_dtype) if kv_bits else model
        with paged_out_after_use(model):  # the reference forward holds about one layer's weights at a time
            report = _verified(reference, Path(out), external_weights, draft_tokens, propose_tokens,
                               with_image=with_image)
        say(report.summary())
    return result


def _verified(model, out: Path, external_weights: bool, draft_tokens: int, propose_tokens: int,
              with_image: bool) -> VerificationReport:
    try:
        if propose_tokens:
            return verify_proposer(model, out)
        if draft_tokens:
            return verify_draft_program(model, out)
        if with_image:  # the vision method's check (verify_vision.py), from the encoder export built above
            return verify_with_image(model, out)
        return verify_decoder(model, out)
    except VerificationError as exc:
        # A program known to be wrong is not left where a loop would load it.
        for path in [out] + ([weights_path(out)] if external_weights else []):
            path.unlink(missing_ok=True)
        raise VerificationError(f"{exc}; removed {out} (verify=False / --no-verify keeps it)") from None
