"""The sampler knobs: one declaration each. Everything else derives from `KNOBS`.

From this table come the program's knob inputs and their order (`program_inputs`, behind
`SamplerConfig.knob_names()`), their export examples, `SamplingParams` and its validation,
`step_inputs`, the OpenAI and LMTP parameters, the `etmlx generate` flags and, through the
decoder metadata (`metadata()`), the flags and input tensors of the C++ `etmlx_decode`.
Semantics and processing order: config.py. Adding a knob: a row here, its kernel in
processing.py, its tests (docs/contributing.md, "A sampler knob"; llm/sampler/README.md).

Table order is the program's input order: programs already exported depend on it, so a new
knob goes at the end (or after the inputs of its feature's last knob, if its feature is new).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
# Step k of a sequence draws with seed + k (and OpenAI choice i adds i * max_seq_len): a seed
# within +-2**62 leaves 2**62 of room below int64's limit for those offsets.
SEED_LIMIT = 2 ** 62
DTYPES = ("float32", "int64", "int32")


class KnobError(ValueError):
    """A knob value out of its range or of the wrong type; `knob` names the parameter."""

    def __init__(self, knob: str, message: str):
        super().__init__(message)
        self.knob = knob


@dataclass(frozen=True)
class Input:
    """One program input a knob fills."""

    name: str
    dtype: str  # "float32", "int64" or "int32"
    off: float | int  # the value that leaves the logits as they are


@dataclass(frozen=True)
class Knob:
    name: str  # SamplingParams field, OpenAI / LMTP parameter, default input name
    dtype: str  # of the value a caller gives: "float32", "int64" or "int32" (packed bits)
    off: float | int  # the default: the knob does nothing
    low: float | int | None  # valid range; None = unbounded on that side
    high: float | int | None
    feature: str | None  # the SamplerConfig field that adds the inputs; None: always there
    flag: str | None  # how `etmlx export --sampler` spells that feature
    doc: str
    low_open: bool = False
    high_open: bool = False
    inputs: tuple[Input, ...] = ()  # () = one input named and typed like the knob
    cli: str | None = ""  # `etmlx generate` / `etmlx_decode` flag; "" = --name-with-dashes; None = none
    api: bool = True  # an OpenAI and LMTP request parameter
    off_means: str | None = "off"  # how the off value reads in messages ("0 = off")
    width: bool = False  # the input is [rows, N], N = the feature's int value (else one value per row)
    words: bool = False  # with width: N = ceil(V / 32) packed 32-bit words per row instead
    rows_only: bool = False  # always one value per row (else a program exported without per_row shares one)
    first: int | None = None  # internal knobs: the value on a sequence's first call
    openai_default: float | int | None = None  # when a request leaves it out (None: off)
    openai_low: float | int | None = None  # OpenAI accepts [openai_low, low) too, meaning off
    openai_high: float | int | None = None  # OpenAI's tighter upper bound

    @property
    def integer(self) -> bool:
        return self.dtype in ("int64", "int32")

    @property
    def program_inputs(self) -> tuple[Input, ...]:
        return self.inputs or (Input(self.name, self.dtype, self.off),)

    @property
    def flag_name(self) -> str | None:
        return None if self.cli is None else self.cli or "--" + self.name.replace("_", "-")

    @property
    def export_hint(self) -> str:
        return f"export with --sampler {self.flag}" if self.flag else f"export with SamplerConfig({self.feature}=...)"

    def range_text(self, low=None, high=None) -> str:
        """"an integer >= 0 (0 = off)", "in (0, 1] (1 = off)": what error messages say."""
        low = self.low if low is None else low
        high = self.high if high is None else high
        if self.integer and high == INT64_MAX:
            high = None  # fits int64: said by "an integer"
        kind = "an integer" if self.integer else "a number"
        if low is not None and high is not None:
            text = f"{kind + ' ' if self.integer else ''}in {'(' if self.low_open else '['}{_show(low)}, " \
                   f"{_show(high)}{')' if self.high_open else ']'}"
        elif low is not None:
            text = f"{kind} {'>' if self.low_open else '>='} {_show(low)}"
        elif high is not None:
            text = f"{kind} {'<' if self.high_open else '<='} {_show(high)}"
        else:
            text = kind
        if self.off_means:
            text += f" ({_show(self.off)} = {self.off_means})"
        return text

    def in_range(self, value, low=None, high=None) -> bool:
        low = self.low if low is None else low
        high = self.high if high is None else high
        if low is not None and (value <= low if self.low_open else value < low):
            return False
        return high is None or (value < high if self.high_open else value <= high)

    def check(self, value, label: str | None = None):
        """`value` as this knob's Python type, or KnobError (wrong type, NaN, out of range)."""
        label = label or self.name
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            raise KnobError(self.name, f"{label} must be {'an integer' if self.integer else 'a number'}, "
                                       f"got {value!r}")
        if not self.integer and math.isnan(value):
            raise KnobError(self.name, f"{label} is NaN")
        if not self.in_range(value):
            raise KnobError(self.name, f"{label} must be {self.range_text()}, got {value!r}")
        return value if self.integer else float(value)


def _show(v) -> str:
    if isinstance(v, int) and abs(v) >= 2 ** 32 and abs(v) & (abs(v) - 1) == 0:  # 2**62, not 4611686018427387904
        return f"{'-' if v < 0 else ''}2**{abs(v).bit_length() - 1}"
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


KNOBS: tuple[Knob, ...] = (
    Knob("temperature", "float32", 0.0, 0, None, None, None, off_means="greedy", openai_default=1.0,
         openai_high=2, doc="divide the logits by T"),
    Knob("seed", "int64", 0, -SEED_LIMIT, SEED_LIMIT, None, None, off_means=None,
         doc="base seed: step k draws with seed + k (seeded programs; room left for the steps)"),
    Knob("top_k", "int64", 0, 0, INT64_MAX, "top_k", "top-k", openai_low=-1,
         doc="keep the k best tokens (k >= V keeps all)"),
    Knob("top_p", "float32", 1.0, 0, 1, "top_p", "top-p", low_open=True,
         doc="keep the smallest best-first set whose probability reaches p"),
    Knob("min_p", "float32", 0.0, 0, 1, "min_p", "min-p", doc="keep tokens with p >= min_p * p_max"),
    Knob("logit_bias", "float32", 0.0, -100, 100, "logit_bias", "logit-bias=N", cli=None, width=True,
         inputs=(Input("bias_ids", "int64", -1), Input("bias_values", "float32", 0.0)),
         doc="token id -> bias added to its logit (-100 bans); ids outside [0, V) are ignored"),
    Knob("presence_penalty", "float32", 0.0, -2, 2, "penalties", "penalties",
         doc="subtract this from the logit of every token already seen"),
    Knob("frequency_penalty", "float32", 0.0, -2, 2, "penalties", "penalties",
         doc="subtract this times the token's count so far"),
    Knob("repetition_penalty", "float32", 1.0, 0, None, "penalties", "penalties", low_open=True,
         doc="divide positive logits of seen tokens by r, multiply negative ones"),
    Knob("penalty_reset", "int64", 0, 0, 1, "penalties", "penalties", cli=None, api=False, first=1,
         doc="internal: 1 zeroes the row's token counts before the step (a new sequence)"),
    Knob("penalty_add", "int64", -1, -1, None, "penalty_seed", None, cli=None, api=False, width=True,
         rows_only=True, doc="internal: ids added to the counts before the step, left-aligned, -1 = none"),
    Knob("allowed_mask", "int32", -1, None, None, "allowed_mask", "mask", cli=None, api=False, width=True,
         words=True, rows_only=True, off_means="unconstrained (all bits set)",
         doc="internal: packed bitmask per row, bit j of word i allows token 32 i + j (llguidance/xgrammar "
             "layout); applied after bias, before temperature and the filters"),
)

BY_NAME = {k.name: k for k in KNOBS}
# The knobs a caller sets (SamplingParams fields, request parameters) in table order.
USER_KNOBS = tuple(k for k in KNOBS if k.api)
# The export flag of each feature, for "exported without it" messages.
FEATURE_FLAGS = tuple(dict.fromkeys(k.flag for k in KNOBS if k.flag))


def enabled(knob: Knob, config) -> bool:
    """Whether a program exported with `config` (a SamplerConfig) has this knob's inputs."""
    return knob.feature is None or bool(getattr(config, knob.feature))


def width(knob: Knob, config, vocab: int | None = None) -> int | None:
    """N of a [rows, N] input: the feature's int value, or ceil(vocab / 32) words for a bitmask."""
    if not knob.width:
        return None
    if knob.words:
        if vocab is None:
            raise ValueError(f"{knob.name} is [rows, ceil(V / 32)]: the vocabulary size is needed")
        return mask_words(vocab)
    return int(getattr(config, knob.feature))


def mask_words(vocab: int) -> int:
    """32-bit words of a packed token bitmask over `vocab` tokens."""
    return (vocab + 31) // 32


def program_inputs(config) -> list[str]:
    """The knob inputs of a program exported with `config`, in the program's order (temperature
    and seed, which come first and exist for every program, excluded)."""
    return [i.name for k in KNOBS if k.feature is not None and enabled(k, config) for i in k.program_inputs]


def parse_features(text: str) -> dict:
    """`etmlx export --sampler top-k,penalties,logit-bias=8` -> SamplerConfig fields."""
    chosen = {}
    spellings = {k.flag.partition("=")[0]: k for k in KNOBS if k.flag}
    for item in (f.strip() for f in text.split(",") if f.strip()):
        name, _, value = item.partition("=")
        knob = spellings.get(name)
        if name == "none":
            continue
        if knob is None or bool(value) != ("=" in knob.flag):
            raise ValueError(f"--sampler: unknown feature {item!r} (choose from {', '.join(FEATURE_FLAGS)}, none)")
        if value:
            try:
                chosen[knob.feature] = int(value)
            except ValueError:
                raise ValueError(f"--sampler {knob.flag} needs an int N, got {item!r}") from None
        else:
            chosen[knob.feature] = True
    return chosen


def metadata() -> list[dict]:
    """The table as the C++ runner reads it (decoder metadata "knobs"): one entry per input,
    every knob of the table (the program's "inputs" say which it has), so a runner can name the
    export flag a missing knob needs. Integer bounds are exact JSON integers; None = unbounded."""
    out = []
    for k in KNOBS:
        for i in k.program_inputs:
            single = not k.inputs  # the value a caller gives is this input's value
            out.append({
                "name": i.name, "dtype": i.dtype, "off": i.off,
                "low": k.low if single else None, "high": k.high if single else None,
                "low_open": k.low_open, "high_open": k.high_open,
                "flag": k.flag_name if single else None,
                "range": k.range_text() if single else None,
                "feature": k.feature, "export": k.export_hint if k.feature else None,
                "first": k.first, "doc": k.doc,
            })
    return out
