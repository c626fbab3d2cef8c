"""What a decode loop needs to know about an exported decoder program, stored inside the .pte.

Beside the tensors, the loop needs the cache length, the vocabulary, the end-of-sequence ids, the
input order, which sampler features were exported, the knob table (for the C++ runner) and the
tokenizer. `etmlx export` stores this dict as JSON in the program's named data (key META_KEY) and the tokenizer's files under
TOKENIZER_PREFIX, so the .pte alone is the model: rename or move it and it still works. Programs
exported before that carry none; their metadata is read from the `FILE.pte.json` sidecar instead.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.knobs import mask_words, metadata as knob_metadata
from backends.mlx.runtime.pte_metadata import named_data

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
FED_OUTPUT = "fed"
# Named-data keys; tools/etmlx_decode/program_metadata.cpp reads the same ones.
META_KEY = "etmlx/decoder_meta.json"
TOKENIZER_PREFIX = "etmlx/tokenizer/"  # + a file name save_pretrained wrote (tokenizer.json, ...)
# Inputs that are int64 (ExecuTorch ScalarType 4); the rest are float32 (6).
_INT_INPUTS = {"tokens", "start_pos", "lengths", DRAFT_INPUT, "seed", "top_k", "penalty_reset", "penalty_add", "bias_ids"}
_INT32_INPUTS = {"allowed_mask"}
_BOOL_INPUTS = {DELIVER_INPUT}
_LONG, _FLOAT, _INT, _BOOL = 4, 6, 3, 11
# Pipelined programs (pipelined.py): a token input that means "the token this row sampled last".
FED_BACK = -1
PIPELINED_HINT = ("structured output needs an unpipelined program (each step's mask depends on the token before "
                  "it): export with --sampler ...,mask (unpipelined by default) or --no-pipeline")


def meta_path(pte: Path) -> Path:
    """The sidecar older exports wrote beside the .pte."""
    return Path(str(pte) + ".json")


def has_embedded_meta(pte: Path) -> bool:
    """Whether `pte` carries its metadata (exported after the sidecar files became optional)."""
    return META_KEY in named_data(pte, [META_KEY])


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
    tokenizer: str | None = None  # TOKENIZER_PREFIX (embedded), or an old sidecar's directory beside the .pte
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
    # (pipelined.py). Absent in programs exported before pipelining: False.
    pipelined: bool = False
    # Drafted tokens a call can verify (--draft-tokens K; 0: a plain program). Absent in older programs: 0.
    draft_tokens: int = 0
    # Some sliding-window layer keeps a ring of `window` slots (kv_cache.py), which a prompt cache may
    # reuse only where positions continue (runtime/decode_rows.h). None: exported before the field (unknown).
    ring_cache: bool | None = None
    # The fewest columns a one-row draft-verifying program's verify input takes: 1, a call without drafts
    # carrying only the last token (as cheap as a plain step's head and sampler); programs exported before
    # the field take at least 2 (their G was declared 2..K+1).
    verify_min_width: int = 2
    # Tokens each call returns per row (--propose-tokens K, a draft model's program, proposer.py): output 0
    # is [B, K], its column 0 the plain program's token. 0: a plain [B] output. Absent in older programs: 0.
    propose_tokens: int = 0
    # The call syntax of tool calls (llm/decoder/tool_formats.py: hermes, llama3_json, mistral, generic), detected
    # from the chat template at export or given with --tool-call-format. "": exported before the field (the
    # server detects it from the template then).
    tool_call_format: str = ""

    @classmethod
    def build(cls, *, max_seq_len, vocab_size, batch, eos_token_ids, seeded, config: SamplerConfig, dtype,
              model_type="", tokenizer=None, prompt_affixes=([], []), pipelined=False,
              draft_tokens=0, ring_cache=None, verify_min_width=1, propose_tokens=0) -> "DecoderMeta":
        model_inputs = MODEL_INPUTS + ([DRAFT_INPUT] if draft_tokens else [])
        if draft_tokens and pipelined:
            model_inputs.append(DELIVER_INPUT)
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
                   verify_min_width=verify_min_width, propose_tokens=propose_tokens)

    @property
    def config(self) -> SamplerConfig:
        return SamplerConfig(**self.sampler)

    @property
    def tokenizer_embedded(self) -> bool:
        return self.tokenizer == TOKENIZER_PREFIX

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=1) + "\n").encode()

    @classmethod
    def load(cls, pte: Path) -> "DecoderMeta":
        """The metadata embedded in `pte`; for programs exported without it, the FILE.pte.json sidecar."""
        blob = named_data(pte, [META_KEY]).get(META_KEY)
        path = f"{pte} (named data {META_KEY})"
        if blob is None:
            path = meta_path(pte)
            if not path.is_file():
                raise FileNotFoundError(f"{pte} carries no etmlx decoder metadata and has no {path.name} beside it: "
                                        "export it with `etmlx export`")
            blob = path.read_bytes()
        try:
            raw = json.loads(blob)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"{path} is not etmlx decoder metadata (format {FORMAT!r} expected)")
        try:
            meta = cls(**raw)
            meta.config  # validates the sampler fields
        except TypeError as exc:
            raise ValueError(f"{path} has unexpected fields: {exc}") from None
        for name in ("max_seq_len", "vocab_size", "batch"):
            value = getattr(meta, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{path}: {name} must be a positive int, got {value!r}")
        if isinstance(meta.draft_tokens, bool) or not isinstance(meta.draft_tokens, int) or meta.draft_tokens < 0:
            raise ValueError(f"{path}: draft_tokens must be an int >= 0, got {meta.draft_tokens!r}")
        if isinstance(meta.propose_tokens, bool) or not isinstance(meta.propose_tokens, int) or meta.propose_tokens < 0:
            raise ValueError(f"{path}: propose_tokens must be an int >= 0, got {meta.propose_tokens!r}")
        if meta.verify_min_width not in (1, 2):
            raise ValueError(f"{path}: verify_min_width must be 1 or 2, got {meta.verify_min_width!r}")
        return meta

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
            if tuple(sizes) != expected:
                raise ValueError(f"{pte}: input {name!r} is {list(sizes)} in the program but the metadata implies "
                                 f"{list(expected)} (batch {self.batch}, max_seq_len {self.max_seq_len}): metadata "
                                 "and program come from different exports")
            want = (_LONG if name in _INT_INPUTS else _INT if name in _INT32_INPUTS else
                    _BOOL if name in _BOOL_INPUTS else _FLOAT)
            if dtype != want:
                raise ValueError(f"{pte}: input {name!r} has dtype code {dtype} in the program, {want} expected from "
                                 "the metadata's input order: metadata and program come from different exports")
