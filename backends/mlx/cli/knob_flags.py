"""The sampler flags of `etmlx generate`, one per caller-set knob of the table (llm/sampler/knobs.py)."""

from __future__ import annotations

from backends.mlx.llm.sampler.knobs import USER_KNOBS, Knob
from backends.mlx.llm.sampler.params import SamplingParams


def _dest(knob: Knob) -> str:
    return knob.flag_name[2:].replace("-", "_")


def add_knob_arguments(parser) -> None:
    """--temperature, --seed, --top-k, ...: typed, defaulting to off, with the table's doc."""
    for knob in USER_KNOBS:
        if knob.flag_name is None:
            continue
        needs = f"; needs --sampler {knob.flag} at export" if knob.flag else ""
        parser.add_argument(knob.flag_name, dest=_dest(knob), type=int if knob.integer else float, default=knob.off,
                            help=f"{knob.doc}; {knob.range_text()}{needs}".replace("%", "%%"))


def params_from_args(args):
    """The SamplingParams the flags ask for (their ranges are checked here, once)."""
    return SamplingParams(**{k.name: getattr(args, _dest(k)) for k in USER_KNOBS if k.flag_name is not None})
