"""`etmlx bench speculative --shape`: the real-size speculative benchmark's code paths on a tiny shape (never
timings): both programs exported and cached side by side, every run giving the plain tokens, and the drafts each
source should produce."""

import pytest

from benchmarks import speculative_shape
from benchmarks import checkpoints as ckpt

pytestmark = pytest.mark.bench

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, architecture="qwen2", rope_theta=1e6)
K = 4


@pytest.fixture(scope="module")
def tiny_shape():
    original, ckpt.SHAPES = ckpt.SHAPES, dict(ckpt.SHAPES, **{"tiny-qwen2": TINY})
    try:
        yield "tiny-qwen2"
    finally:
        ckpt.SHAPES = original


@pytest.fixture(scope="module")
def runs(tiny_shape, tmp_path_factory):
    cache = tmp_path_factory.mktemp("speculative-shape")
    logs = []
    first = speculative_shape.run(tiny_shape, cache, draft_tokens=K, prompt_len=8, max_tokens=12, repeats=1,
                                  log=logs.append)
    second = speculative_shape.run(tiny_shape, cache, draft_tokens=K, prompt_len=8, max_tokens=12, repeats=1,
                                   log=logs.append)
    return first, second, logs


def test_every_run_is_reported_with_its_drafts(runs):
    report, _, _ = runs
    assert set(report["decode_tok_s"]) == {"plain", "prediction", "none", "miss"}
    assert all(rate > 0 for rate in report["decode_tok_s"].values())
    assert set(report["vs_plain"]) == {"prediction", "none", "miss"} and len(report["rounds"]) == 1
    assert report["tokens"] == 12 and report["draft_tokens"] == K
    drafts = report["drafts"]
    # The prediction is the plain run's own tokens: every draft passes, and a call carries up to K of them.
    assert drafts["prediction"]["proposed"] > 0
    assert drafts["prediction"]["accepted"] == drafts["prediction"]["proposed"]
    assert drafts["prediction"]["calls"] < report["tokens"]
    # a call per token, and one more: the program is pipelined, its first token comes with its second call
    assert drafts["none"] == {"proposed": 0, "accepted": 0, "calls": report["tokens"] + 1}
    assert drafts["miss"]["accepted"] == 0


def test_both_programs_are_cached_side_by_side(runs):
    first, second, logs = runs
    assert first["programs"] == second["programs"]
    plain, draft = (p for p in (first["programs"]["plain"], first["programs"]["draft"]))
    assert plain != draft and all(path.endswith(".pte") for path in (plain, draft))
    # The second run exported nothing: each program's export removes only its own engine's older files.
    assert sum("cached" in line for line in logs) == 2


def test_unknown_shape_is_one_line_error(tmp_path):
    with pytest.raises(ValueError, match="--shape must be one of"):
        speculative_shape.run("no-such-model", tmp_path)
