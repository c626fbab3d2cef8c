"""SamplingParams: one sequence's knob values, with a field per caller-set knob of the table.

Values are validated once, when a SamplingParams is made (it is frozen, so they stay valid);
`check(config, vocab_size)` then only asks whether a given program can apply them.
"""

from __future__ import annotations

from dataclasses import field, make_dataclass

from backends.mlx.llm.sampler.knobs import USER_KNOBS, Knob, KnobError, enabled, width


def _check_pairs(knob: Knob, pairs) -> dict:
    if not isinstance(pairs, dict):
        raise KnobError(knob.name, f"{knob.name} must be a dict of token id -> value, got {type(pairs).__name__}")
    for token, value in pairs.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise KnobError(knob.name, f"{knob.name} keys must be token ids (ints >= 0), got {token!r}")
        knob.check(value, f"{knob.name} values")
    return pairs


class _Knobs:
    def __post_init__(self):
        for knob in USER_KNOBS:
            value = getattr(self, knob.name)
            _check_pairs(knob, value) if knob.width else knob.check(value)

    def is_off(self, knob: Knob) -> bool:
        value = getattr(self, knob.name)
        return not value if knob.width else value == knob.off

    def check(self, config, vocab_size: int) -> None:
        """Refuse what a program exported with `config` (a SamplerConfig) over `vocab_size` tokens
        cannot apply: a knob it lacks (naming the export flag), more pairs than it takes, ids
        outside the vocabulary. Raises KnobError."""
        for knob in USER_KNOBS:
            if self.is_off(knob):
                continue
            if not enabled(knob, config):
                raise KnobError(knob.name, f"{knob.name}: this program was exported without it ({knob.export_hint})")
            if knob.width:
                pairs = getattr(self, knob.name)
                if len(pairs) > width(knob, config):
                    raise KnobError(knob.name, f"{knob.name}: {len(pairs)} entries but the program takes at most "
                                               f"{width(knob, config)} ({knob.export_hint})")
                bad = [t for t in pairs if t >= vocab_size]
                if bad:
                    raise KnobError(knob.name, f"{knob.name} keys must be token ids in [0, {vocab_size}), "
                                               f"got {bad[0]}")


def _field(knob: Knob):
    if knob.width:
        return knob.name, dict, field(default_factory=dict)
    return knob.name, int if knob.integer else float, field(default=knob.off)


SamplingParams = make_dataclass(
    "SamplingParams", [_field(k) for k in USER_KNOBS], bases=(_Knobs,), frozen=True)
SamplingParams.__module__ = __name__  # for pickling and repr (make_dataclass takes no module= before 3.12)
SamplingParams.__doc__ = ("One sequence's sampling settings, one field per knob of the table "
                          f"({', '.join(k.name for k in USER_KNOBS)}); the defaults are off "
                          "(temperature 0 = greedy). Out-of-range values raise KnobError (a ValueError).")
