"""The export options a split (tensor- or pipeline-parallel) program is not built with yet, refused in one line
before any checkpoint is read (no heavy imports here: `etmlx export` checks its flags first)."""

from __future__ import annotations

# What each kind of split program is not built with yet: option -> why (a draft model is small: it runs whole
# beside the split target).
NOT_SPLIT_WITH = {
    "tensor_parallel": {"propose_tokens": "a draft model's proposing program is not sharded"},
    "pipeline_parallel": {"tensor_parallel": "not built together with tensor_parallel yet (choose one)",
                          "propose_tokens": "not built with propose_tokens yet"},
}


def check_split_options(kind: str, **options) -> None:
    """ValueError ("KIND: why", one line) for the first option set that a `kind` program is not built with."""
    for option, why in NOT_SPLIT_WITH[kind].items():
        if options.get(option):  # tensor_parallel: given as "more than one rank"
            raise ValueError(f"{kind}: {why}")
