"""What a decode loop needs to know about an exported decoder program, stored inside the .pte.

Beside the tensors, the loop needs the cache length, the vocabulary, the end-of-sequence ids, the
input order, which sampler features were exported, the knob table (for the C++ runner) and the
tokenizer. `etmlx export` stores a DecoderMeta as a flatbuffer (serialization/decoder_meta.fbs) in the
program's named data (key META_KEY) and the tokenizer's files under TOKENIZER_PREFIX, so the .pte alone
is the model: rename or move it and it still works. The C++ tools read the same flatbuffer with the
flatc-generated header (tools/etmlx_decode/decoder_meta.cpp). A program without it (or with the JSON
metadata of older exports) is refused: it must be re-exported.

The dataclass and the flatbuffer table have the same fields, mapped by name (_pack / _unpack): a new field
is one line in decoder_meta.fbs and one line here.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import flatbuffers

from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.knobs import mask_words, metadata as knob_metadata
from backends.mlx.runtime.pte_metadata import named_data
from backends.mlx.serialization.generated.fb import DecoderMeta as fb_meta
from backends.mlx.serialization.generated.fb.DecoderKnob import DecoderKnobT
from backends.mlx.serialization.generated.fb.DecoderMeta import DecoderMetaT
from backends.mlx.serialization.generated.fb.DecoderSampler import DecoderSamplerT
from backends.mlx.serialization.generated.fb.PixelSteps import PixelStepsT
from backends.mlx.serialization.generated.fb.KnobNumber import KnobNumberT

FORMAT = "etmlx-decoder/1"
MODEL_INPUTS = ["tokens", "start_pos", "lengths"]
# Programs exported with --draft-tokens K take this after the model inputs: [B, G] (G dynamic, 1..K+1, for one
# row: DecoderMeta.verify_min_width..K+1; K+1 for more), per row
# its last accepted token, then its drafts (the last real tokens of `tokens`), -1 padding
# (decoder/speculative_head.py); they return (accepted, token).
DRAFT_INPUT = "verify"
DRAFT_OUTPUTS = ["accepted", "token"]
# A pipelined draft-verifying program (pipelined_verify.py) also takes `deliver` [B] bool after `verify`
# (true: the call returns its own outputs; false: the previous call's token, without waiting for this one)
# and returns `fed` [B], the token each row's column 0 used in place of FED_BACK.
DELIVER_INPUT = "deliver"
# Programs exported with switchable LoRA adapters (llm/lora/switchable.py) take this after the model inputs:
# [B] int64, per row 0 (no adapter) or i, the i-th name of DecoderMeta.adapters.
ADAPTER_INPUT = "adapter"
FED_OUTPUT = "fed"
# Vision-language programs (vision_export.py) take this after the model inputs: [B, L, D] float32, the image
# embedding of each position whose token is DecoderMeta.image_token_id (other positions' values are unread).
IMAGE_INPUT = "image_embeds"
# Programs with multimodal RoPE (Qwen2-VL, qwen2_vl.py) take this after image_embeds: [B, L, 3] int64, each token's
# rotary position per section (temporal, height, width).
ROPE_INPUT = "rope_positions"
# Named-data keys; tools/etmlx_decode/program_metadata.cpp reads the same ones.
META_KEY = "etmlx/decoder_meta"  # a DecoderMeta flatbuffer (decoder_meta.fbs, file identifier FILE_IDENTIFIER)
FILE_IDENTIFIER = b"EMDM"
OLD_META_KEY = "etmlx/decoder_meta.json"  # the JSON of older exports: refused, named in the message
TOKENIZER_PREFIX = "etmlx/tokenizer/"  # + a file name save_pretrained wrote (tokenizer.json, ...)
PROCESSOR_PREFIX = "etmlx/processor/"  # + the image processor's config file (vision-language programs)
# Inputs that are int64 (ExecuTorch ScalarType 4); the rest are float32 (6).
_INT_INPUTS = {"tokens", "start_pos", "lengths", DRAFT_INPUT, ADAPTER_INPUT, "seed", "top_k", "penalty_reset", "penalty_add", "bias_ids",
               ROPE_INPUT}
_INT32_INPUTS = {"allowed_mask"}
_BOOL_INPUTS = {DELIVER_INPUT}
_LONG, _FLOAT, _INT, _BOOL = 4, 6, 3, 11
# Pipelined programs (pipelined.py): a token input that means "the token this row sampled last".
FED_BACK = -1
PIPELINED_HINT = ("structured output needs an unpipelined program (each step's mask depends on the token before "
                  "it): export with --sampler ...,mask (unpipelined by default) or --no-pipeline")


def has_embedded_meta(pte: Path) -> bool:
    """Whether `pte` carries this etmlx's decoder metadata."""
    return META_KEY in named_data(pte, [META_KEY])


class StaleProgramError(ValueError):
    """The program carries no decoder metadata this etmlx reads: it must be re-exported."""


def _camel(name: str) -> str:
    """The attribute flatc's Python object API gives a schema field (snake_case -> camelCase)."""
    return re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), name)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _plain(value):
    """An object-API value as plain Python: str for bytes, lists for vectors (numpy included), dicts for tables."""
    if isinstance(value, bytes):
        return value.decode()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if hasattr(value, "__dict__"):
        return {_snake(k): _plain(v) for k, v in vars(value).items()}
    return value


_KNOB_NUMBERS = ("off", "low", "high", "first")


def _knob_table(knob: dict) -> DecoderKnobT:
    t = DecoderKnobT()
    for key, value in knob.items():
        if key in _KNOB_NUMBERS and value is not None:  # both ways, as C++'s KnobValue (knobs.h)
            value = KnobNumberT(i=int(value), f=float(value))
        setattr(t, _checked_attr(t, key, "knob"), value)
    return t


def _knob_dict(table: dict) -> dict:
    out = dict(table)
    for key in _KNOB_NUMBERS:
        if out.get(key) is not None:
            out[key] = out[key]["f" if out["dtype"] == "float32" else "i"]
    return out


def _checked_attr(table, name: str, what: str) -> str:
    attr = _camel(name)
    if not hasattr(table, attr):
        raise AttributeError(f"the {what} field {name!r} has no field in serialization/decoder_meta.fbs: add it there "
                             "and run `make regenerate`")
    return attr


def _pack(meta: "DecoderMeta") -> bytes:
    t = DecoderMetaT()
    for f in dataclasses.fields(meta):
        value = getattr(meta, f.name)
        if f.name == "sampler":
            sampler = DecoderSamplerT()
            for key, v in value.items():
                attr = _checked_attr(sampler, key, "sampler")
                if isinstance(getattr(sampler, attr), bool):  # a feature switch: any truthy value turns it on
                    v = bool(v)
                setattr(sampler, attr, v)
            value = sampler
        elif f.name == "knobs":
            value = [_knob_table(k) for k in value]
        elif f.name == "pixel_steps" and value is not None:
            steps = PixelStepsT()
            for key, v in value.items():
                setattr(steps, _checked_attr(steps, key, "pixel_steps"), v)
            value = steps
        setattr(t, _checked_attr(t, f.name, "DecoderMeta"), value)
    builder = flatbuffers.Builder(1024)
    builder.Finish(t.Pack(builder), file_identifier=FILE_IDENTIFIER)
    return bytes(builder.Output())


def _unpack(blob: bytes, where: str) -> dict:
    """The DecoderMeta fields of a flatbuffer; a field the file lacks takes the dataclass's default."""
    if len(blob) < 8 or not fb_meta.DecoderMeta.DecoderMetaBufferHasIdentifier(blob, 0):
        raise ValueError(f"{where} is not etmlx decoder metadata (file identifier {FILE_IDENTIFIER.decode()} expected)")
    try:
        table = DecoderMetaT.InitFromPackedBuf(bytearray(blob), 0)
    except Exception as exc:  # flatbuffers raises struct.error / IndexError on a truncated buffer
        raise ValueError(f"{where} is not a valid decoder metadata flatbuffer: {exc}") from None
    raw = {}
    for f in dataclasses.fields(DecoderMeta):
        value = getattr(table, _camel(f.name))
        if value is None and f.default is not dataclasses.MISSING:
            value = f.default
        elif value is None and f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        raw[f.name] = _plain(value)
    if raw["sampler"] is None:
        raise ValueError(f"{where} has no sampler table")
    raw["knobs"] = [_knob_dict(k) for k in raw["knobs"]]
    return raw


@dataclass
class DecoderMeta:
    max_seq_len: int
    vocab_size: int
    batch: int
    eos_token_ids: list[int]
    seeded: bool
    sampler: dict  # SamplerConfig fields
    dtype: str
    model_type: str = ""
    tokenizer: str | None = None  # TOKENIZER_PREFIX: the tokenizer's files are embedded; None: exported without one
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    # Every knob of the table as a runner without Python needs it (knobs.metadata()): etmlx_decode
    # builds its flags, range checks and input tensors from this list.
    knobs: list[dict] = field(default_factory=list)
    format: str = FORMAT
    # The ids the tokenizer adds around a text with add_special_tokens=True (BOS, typically), recorded at
    # export so a runner with a plain tokenizer library (tools/etmlx_decode) adds the same ones.
    prompt_prefix_ids: list[int] = field(default_factory=list)
    prompt_suffix_ids: list[int] = field(default_factory=list)
    # Each call returns the previous call's outputs; a token input < 0 is the row's last sampled token
    # (pipelined.py).
    pipelined: bool = False
    # Drafted tokens a call can verify (--draft-tokens K; 0: a plain program).
    draft_tokens: int = 0
    # Some sliding-window layer keeps a ring of `window` slots (kv_cache.py), which a prompt cache may
    # reuse only where positions continue (runtime/decode_rows.h). None: the exporter did not say (treated as a ring).
    ring_cache: bool | None = None
    # The fewest columns a one-row draft-verifying program's verify input takes: 1, a call without drafts
    # carrying only the last token (as cheap as a plain step's head and sampler); programs exported before
    # the field take at least 2 (their G was declared 2..K+1).
    verify_min_width: int = 2
    # Tokens each call returns per row (--propose-tokens K, a draft model's program, proposer.py): output 0
    # is [B, K], its column 0 the plain program's token. 0: a plain [B] output.
    propose_tokens: int = 0
    # The call syntax of tool calls (llm/decoder/tool_formats.py: hermes, llama3_json, mistral, generic), detected
    # from the chat template at export or given with --tool-call-format. "": exported before the field (the
    # server detects it from the template then).
    tool_call_format: str = ""
    # The KV cache's quantization (--kv-bits, llm/decoder/kv_quant.py): 4 or 8 bits, kv_group_size values of the
    # head dimension per scale and bias; 0: a float cache in `dtype`.
    kv_bits: int = 0
    kv_group_size: int = 0
    # A tensor-parallel program (--tensor-parallel N, llm/distributed/): N files, one per rank, and this is rank
    # `rank`'s; every rank runs the same steps (docs/distributed.md). 1: a plain program.
    ranks: int = 1
    rank: int = 0
    # Vision-language programs (vision_export.py): the token id an image's positions carry in the prompt, how many
    # positions one image takes, the width of the image_embeds input, the method that turns pixels [N, *image_size]
    # into embeddings [N, image_tokens, image_embed_dim]; the image processor's settings are named data under
    # PROCESSOR_PREFIX. -1 / "": a text-only program.
    image_token_id: int = -1
    image_tokens: int = 0
    image_embed_dim: int = 0
    vision_method: str = ""
    image_size: list[int] = field(default_factory=list)
    # Switchable LoRA adapters (etmlx export --adapters NAME=DIR,...): the `adapter` input's value i > 0 applies
    # the i-th name's; [] for a program without them.
    adapters: list[str] = field(default_factory=list)
    # How prompt text names an image (gemma3_vision.py): [mark, before, image token, after], each mark the chat
    # template writes becoming before + image token * image_tokens + after before tokenizing, as the checkpoint's
    # processor does; []: the image token, expanded in ids (image_prompt.expand_images).
    image_text: list[str] = field(default_factory=list)
    # A family whose image takes a varying number of tiles (Idefics3 / SmolVLM: tile_prompt.py; LLaVA-NeXT and
    # LLaVA-OneVision: anyres.py, their tiles' features packed on the host): how an image token expands, as JSON; then
    # image_tokens are one tile's positions and the vision method encodes one tile. Mistral 3
    # (mistral3_vision.py): the image's rows of image_tokens positions, with their break and end tokens.
    # "": each image is image_tokens positions of image_token_id.
    image_prompt: str = ""
    # The image processor's steps for a runner without Python (llm/vision/preprocess.py pixel_steps: a dict of the
    # PixelSteps table's fields); None where the family's processing is not one fixed pipeline.
    pixel_steps: dict | None = None

    @classmethod
    def build(cls, *, max_seq_len, vocab_size, batch, eos_token_ids, seeded, config: SamplerConfig, dtype,
              model_type="", tokenizer=None, prompt_affixes=([], []), pipelined=False,
              draft_tokens=0, ring_cache=None, verify_min_width=1, propose_tokens=0, vision=None,
              adapters=()) -> "DecoderMeta":
        """`vision`: a vision-language program's (image_token_id, image_tokens, image_embed_dim, vision_method,
        image_size)."""
        model_inputs = MODEL_INPUTS + ([IMAGE_INPUT] if vision else []) + ([DRAFT_INPUT] if draft_tokens else [])
        if draft_tokens and pipelined:
            model_inputs.append(DELIVER_INPUT)
        if adapters:
            model_inputs.append(ADAPTER_INPUT)
        inputs = model_inputs + ["temperature"] + (["seed"] if seeded else []) + config.knob_names()
        outputs = ["token"] + (["logprob", "top_ids", "top_logprobs"] if config.logprobs else [])
        if propose_tokens:
            outputs = ["tokens"]
        if draft_tokens:
            outputs = list(DRAFT_OUTPUTS) + ([FED_OUTPUT] if pipelined else [])
        if config.expose_counts:
            outputs.append("penalty_state")
        return cls(max_seq_len=max_seq_len, vocab_size=vocab_size, batch=batch, eos_token_ids=list(eos_token_ids),
                   seeded=seeded, sampler=asdict(config), dtype=dtype, model_type=model_type, tokenizer=tokenizer,
                   inputs=inputs, outputs=outputs, knobs=knob_metadata(),
                   prompt_prefix_ids=list(prompt_affixes[0]), prompt_suffix_ids=list(prompt_affixes[1]),
                   pipelined=pipelined, draft_tokens=draft_tokens, ring_cache=ring_cache,
                   verify_min_width=verify_min_width, propose_tokens=propose_tokens, adapters=list(adapters),
                   **(dict(zip(("image_token_id", "image_tokens", "image_embed_dim", "vision_method", "image_size"),
                               vision)) if vision else {}))

    @property
    def takes_images(self) -> bool:
        """Whether the program has a vision method and takes image embeddings."""
        return bool(self.vision_method)

    @property
    def config(self) -> SamplerConfig:
        return SamplerConfig(**self.sampler)

    def adapter_index(self, name: str | None) -> int:
        """The `adapter` input's value for adapter `name` (None or "": 0, no adapter); ValueError naming the
        program's adapters for an unknown one."""
        if not name:
            return 0
        if name in self.adapters:
            return self.adapters.index(name) + 1
        known = f"its adapters are {', '.join(self.adapters)}" if self.adapters else "it has no switchable adapters"
        raise ValueError(f"adapter {name!r} is not in this program ({known})")

    @property
    def tokenizer_embedded(self) -> bool:
        return self.tokenizer == TOKENIZER_PREFIX

    def to_bytes(self) -> bytes:
        """The flatbuffer `etmlx export` stores under META_KEY."""
        return _pack(self)

    @classmethod
    def from_bytes(cls, blob: bytes, where: str = "decoder metadata") -> "DecoderMeta":
        """Parse and check the flatbuffer `blob` (`where` names it in errors)."""
        raw = _unpack(blob, where)
        if raw["format"] != FORMAT:
            raise ValueError(f"{where} is not etmlx decoder metadata (format {FORMAT!r} expected)")
        try:
            meta = cls(**raw)
            meta.config  # validates the sampler fields
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        for name in ("max_seq_len", "vocab_size", "batch"):
            value = getattr(meta, name)
            if value < 1:
                raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
        for name in ("draft_tokens", "propose_tokens"):
            if getattr(meta, name) < 0:
                raise ValueError(f"{where}: {name} must be an int >= 0, got {getattr(meta, name)!r}")
        if meta.kv_bits not in (0, 4, 8) or (meta.kv_bits and meta.kv_group_size not in (32, 64, 128)):
            raise ValueError(f"{where}: kv_bits {meta.kv_bits!r} / kv_group_size {meta.kv_group_size!r} are not a "
                             "KV cache setting (0, or 4 or 8 bits in groups of 32, 64 or 128)")
        if meta.verify_min_width not in (1, 2):
            raise ValueError(f"{where}: verify_min_width must be 1 or 2, got {meta.verify_min_width!r}")
        return meta

    @classmethod
    def load(cls, pte: Path) -> "DecoderMeta":
        """The metadata embedded in `pte`; StaleProgramError for a program without it."""
        blobs = named_data(pte, [META_KEY, OLD_META_KEY])
        if META_KEY not in blobs:
            why = "older etmlx metadata (JSON)" if OLD_META_KEY in blobs else "no etmlx decoder metadata"
            raise StaleProgramError(f"{pte} carries {why}: re-export it with `etmlx export`")
        return cls.from_bytes(blobs[META_KEY], f"{pte} (named data {META_KEY})")

    def check_program(self, pte, inputs: list[tuple[tuple[int, ...], int]], drafts: bool = False) -> None:
        """Fail clearly when the metadata does not describe the program: `inputs` is the loaded method's
        (sizes, ExecuTorch dtype code) per input, in call order. `drafts`: the caller drives draft-verifying
        programs (decoder/speculative.py); other callers refuse them, whose calling convention differs."""
        if self.draft_tokens and not drafts:
            raise ValueError(f"{pte} verifies drafted tokens (exported with --draft-tokens {self.draft_tokens}): "
                             "this decode loop cannot drive it; use backends.mlx.llm.decoder.speculative, or "
                             "export without --draft-tokens")
        if len(inputs) != len(self.inputs):
            raise ValueError(f"{pte}: the metadata lists {len(self.inputs)} inputs ({', '.join(self.inputs)}) but "
                             f"the program takes {len(inputs)}: metadata and program come from different exports")
        widths = {"tokens": self.max_seq_len, "penalty_add": self.config.penalty_seed,
                  "bias_ids": self.config.logit_bias, "bias_values": self.config.logit_bias,
                  "allowed_mask": mask_words(self.vocab_size), DRAFT_INPUT: self.draft_tokens + 1}
        for name, (sizes, dtype) in zip(self.inputs, inputs):
            expected = (self.batch, widths[name]) if name in widths else (self.batch,)
            if name == "allowed_mask" and self.draft_tokens:  # a mask per verified position: [B, G, words]
                expected = (self.batch, self.draft_tokens + 1, widths[name])
            if name == IMAGE_INPUT:
                expected = (self.batch, self.max_seq_len, self.image_embed_dim)
            if name == ROPE_INPUT:
                expected = (self.batch, self.max_seq_len, 3)
            if tuple(sizes) != expected:
                raise ValueError(f"{pte}: input {name!r} is {list(sizes)} in the program but the metadata implies "
                                 f"{list(expected)} (batch {self.batch}, max_seq_len {self.max_seq_len}): metadata "
                                 "and program come from different exports")
            want = (_LONG if name in _INT_INPUTS else _INT if name in _INT32_INPUTS else
                    _BOOL if name in _BOOL_INPUTS else _FLOAT)
            if dtype != want:
                raise ValueError(f"{pte}: input {name!r} has dtype code {dtype} in the program, {want} expected from "
                                 "the metadata's input order: metadata and program come from different exports")
