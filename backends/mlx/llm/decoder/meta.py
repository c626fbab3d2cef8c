"""What a decode loop needs to know about an exported decoder program: `FILE.pte.json` beside it.

The .pte itself carries only tensors; the loop also needs the cache length, the vocabulary, the
end-of-sequence ids, the input order, which sampler features were exported, the knob table (for
the C++ runner) and where the tokenizer is (a directory beside the .pte, so a .pte path is all
`etmlx generate` needs).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.knobs import metadata as knob_metadata

FORMAT = "etmlx-decoder/1"
MODEL_INPUTS = ["tokens", "start_pos", "lengths"]


def meta_path(pte: Path) -> Path:
    return Path(str(pte) + ".json")


def tokenizer_path(pte: Path) -> Path:
    return Path(str(pte) + ".tokenizer")


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
    tokenizer: str | None = None  # directory name beside the .pte
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    # Every knob of the table as a runner without Python needs it (knobs.metadata()): etmlx_decode
    # builds its flags, range checks and input tensors from this list.
    knobs: list[dict] = field(default_factory=list)
    format: str = FORMAT

    @classmethod
    def build(cls, *, max_seq_len, vocab_size, batch, eos_token_ids, seeded, config: SamplerConfig, dtype,
              model_type="", tokenizer=None) -> "DecoderMeta":
        inputs = MODEL_INPUTS + ["temperature"] + (["seed"] if seeded else []) + config.knob_names()
        outputs = ["token"] + (["logprob", "top_ids", "top_logprobs"] if config.logprobs else [])
        if config.expose_counts:
            outputs.append("penalty_state")
        return cls(max_seq_len=max_seq_len, vocab_size=vocab_size, batch=batch, eos_token_ids=list(eos_token_ids),
                   seeded=seeded, sampler=asdict(config), dtype=dtype, model_type=model_type, tokenizer=tokenizer,
                   inputs=inputs, outputs=outputs, knobs=knob_metadata())

    @property
    def config(self) -> SamplerConfig:
        return SamplerConfig(**self.sampler)

    def save(self, pte: Path) -> Path:
        path = meta_path(pte)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, pte: Path) -> "DecoderMeta":
        path = meta_path(pte)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: a decoder .pte needs the metadata `etmlx export` writes "
                                    "beside it")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
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
        return meta
