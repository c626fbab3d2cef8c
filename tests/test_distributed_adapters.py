"""Switchable LoRA adapters (`--adapters NAME=DIR,...`) in split programs: under tensor parallelism each rank
holds its share of every adapter (B's output rows beside a column-sharded linear, A's input columns beside a
row-sharded one, summed with the base's partial product); under pipeline parallelism each stage holds its layers'
adapters and reads the one adapter choice of its program. The 2-rank programs decode the one-rank program's tokens
on each adapter and on none (`etmlx generate --adapter-name`); the adapters' tokens differ from the base's (a
control: an adapter ignored on some rank would be seen). A PEFT adapter of rank 4 (8 on down_proj) and an mlx-lm
one of rank 2 on a tiny random Llama (q, v and down projections: both kinds of split)."""

from __future__ import annotations

import pytest

from adapter_helpers import PROMPT, STEPS, checkpoint, distinct, mlx_lm_adapter, peft_adapter
from backends.mlx.cli.main import main
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.rank_programs import rank_tokens

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(checkpoint dir, adapters flag, {adapter or None: the one-rank program's tokens})."""
    tmp = tmp_path_factory.mktemp("split_adapters")
    base = checkpoint(tmp / "base")
    adapters = f"a={peft_adapter(base, tmp / 'peft')},b={mlx_lm_adapter(tmp / 'mlx', rank=2, seed=5)}"
    assert main(["export", "--model", str(base), "--out", str(tmp / "one.pte"), "--max-seq-len", "96",
                 "--adapters", adapters, "--no-verify"]) == 0
    one = Decoder(tmp / "one.pte")
    tokens = {name: one.generate(PROMPT, STEPS, adapter=name).tokens for name in (None, "a", "b")}
    distinct(tokens["a"], tokens[None])
    distinct(tokens["b"], tokens[None])
    assert tokens["a"] != tokens["b"]
    return base, adapters, tokens


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_two_ranks_decode_each_adapters_tokens(exported, tmp_path, split):
    base, adapters, expected = exported
    out = tmp_path / f"{split}.pte"
    # the export's own check: the 2 ranks (base model) against the eager model
    assert main(["export", "--model", str(base), "--out", str(out), "--max-seq-len", "96", "--adapters", adapters,
                 f"--{split}-parallel", "2"]) == 0
    for name, tokens in expected.items():
        assert rank_tokens(out, PROMPT, STEPS, extra=("--adapter-name", name) if name else ()) == tokens, name
