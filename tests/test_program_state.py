"""Host access to a decoder program's KV cache (runtime/program_state.cpp, program_state.py): a row's entries
read into host memory are the eager StaticCacheLM's for the same tokens, a write puts exactly what was given
back (in the state's dtype, bfloat16 too), a copy moves one row's positions [0, n) into another and nothing
else, and bad requests are one-line errors, never a crash."""

from __future__ import annotations

import pytest
import torch

from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.kv_cache import StaticCacheLM
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.runtime.program_state import ProgramState, StateError
from backends.mlx.runtime.runner import load_method
from serve_helpers import eager_model

PROMPT = [5, 17, 42, 9, 77, 3, 120, 64]
MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def eager():
    return eager_model()


@pytest.fixture(scope="module")
def programs(tmp_path_factory, eager):
    model, tokenizer = eager
    out = tmp_path_factory.mktemp("program_state")
    paths = {"float32": out / "f32.pte", "bfloat16": out / "bf16.pte"}
    export_decoder(model, paths["float32"], MAX_SEQ_LEN, batch=2, tokenizer=tokenizer, pipelined=False, verify=False)
    half = eager_model()[0].to(torch.bfloat16)
    export_decoder(half, paths["bfloat16"], MAX_SEQ_LEN, batch=2, tokenizer=tokenizer, verify=False)
    return paths


def _prefilled(path):
    decoder = Decoder(path)
    list(decoder.stream(PROMPT, 1, SamplingParams(), reuse=True))  # row 0 now holds PROMPT
    assert decoder.rows.caches.held(0)[:len(PROMPT)] == PROMPT
    return decoder


def test_read_gives_the_eager_cache_entries(programs, eager):
    decoder = _prefilled(programs["float32"])
    entries = decoder.method.state.read(0, len(PROMPT))
    lm = StaticCacheLM(eager[0], MAX_SEQ_LEN, batch=1)
    with torch.no_grad():
        lm(torch.tensor([PROMPT]), torch.zeros(1, dtype=torch.int64))
    expected = [b[0, :, :len(PROMPT)] for name, b in lm.named_buffers() if "_cache_" in name]
    assert len(entries) == len(expected)
    # the program's buffers are the module's, in its order (k_cache_0, v_cache_0, ...)
    for got, want in zip(entries, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert any(e.abs().sum() > 0 for e in entries)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_then_read_round_trips_in_the_state_dtype(programs, dtype):
    decoder = _prefilled(programs[dtype])
    state = decoder.method.state
    assert {b.dtype for b in state.buffers} == {getattr(torch, dtype)}
    n = 5
    new = [torch.randn(b.shape[1], n, b.shape[3]).to(b.dtype) for b in state.buffers]
    before_row0 = state.read(0, len(PROMPT))
    state.write(1, n, new)
    assert all(torch.equal(a, b) for a, b in zip(state.read(1, n), new))
    assert all(torch.equal(a, b) for a, b in zip(state.read(0, len(PROMPT)), before_row0))  # other row untouched


def test_copy_moves_a_prefix_between_rows_and_nothing_more(programs):
    decoder = _prefilled(programs["float32"])
    state = decoder.method.state
    width = len(PROMPT) + 4
    marker = [torch.full((b.shape[1], width, b.shape[3]), 7.0) for b in state.buffers]
    state.write(1, width, marker)
    state.copy(0, 1, len(PROMPT))
    row0, row1 = state.read(0, width), state.read(1, width)
    for a, b in zip(row0, row1):
        assert torch.equal(a[:, :len(PROMPT)], b[:, :len(PROMPT)])
        assert torch.all(b[:, len(PROMPT):] == 7.0)  # positions past n keep what they held


def test_a_generation_from_a_copied_row_gives_the_same_tokens(programs):
    decoder = _prefilled(programs["float32"])
    params = SamplingParams(temperature=1.0, seed=3)
    fresh = [s.token for s in Decoder(programs["float32"]).stream(PROMPT + [9, 9], 8, params)]
    decoder.method.state.copy(0, 1, len(PROMPT))
    decoder.rows.caches.rows[0].tokens = []  # row 0 forgets: only row 1 (the copy) holds the prefix
    decoder.rows.caches.rows[1].tokens = list(PROMPT)
    reused = [s.token for s in decoder.stream(PROMPT + [9, 9], 8, params, reuse=True)]
    assert decoder.last_cached == len(PROMPT)
    assert reused == fresh


def test_bad_requests_are_one_line_errors(programs):
    decoder = _prefilled(programs["float32"])
    state = decoder.method.state
    for call, message in [(lambda: state.read(2, 3), "row 2 is out of range: the program has 2 rows"),
                          (lambda: state.read(-1, 3), "row -1 is out of range"),
                          (lambda: state.read(0, MAX_SEQ_LEN + 1), f"n = {MAX_SEQ_LEN + 1} is beyond the cache"),
                          (lambda: state.copy(0, 5, 3), "target row 5 is out of range"),
                          (lambda: state.copy(0, 1, -1), "n = -1 is beyond the cache"),
                          (lambda: state.write(0, 2, state.read(0, 3)), "the program's buffer needs"),
                          (lambda: ProgramState(10 ** 9), "no loaded program has state id")]:
        with pytest.raises(StateError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


def test_an_unloaded_program_is_an_error_not_a_crash(programs):
    method = load_method(programs["float32"])
    state = method.state
    del method
    import gc

    gc.collect()
    with pytest.raises(StateError, match="no loaded program has state id"):
        state.read(0, 1)


def test_a_program_without_state_has_no_kv_access(tmp_path):
    from backends.mlx.exporter.export import export_to_pte

    class Add(torch.nn.Module):
        def forward(self, x):
            return x + 1

    result = export_to_pte(Add(), (torch.ones(2),), {})
    pte = tmp_path / "add.pte"
    result.save(pte)
    with pytest.raises(StateError, match="0 stateful etmlx delegates"):
        load_method(pte).state


def test_a_stateful_program_without_a_kv_cache_is_not_a_decoder_program(tmp_path):
    from backends.mlx.exporter.export import export_to_pte

    class Counter(torch.nn.Module):  # state, but no [rows, heads, positions, dim] buffer
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(2, 3))

        def forward(self, x):
            self.count.add_(x)
            return self.count.clone()

    pte = tmp_path / "counter.pte"
    export_to_pte(Counter(), (torch.ones(2, 3),), {}).save(pte)
    method = load_method(pte)
    assert len(method.state_ids) == 1 and not method.can_copy_rows
    with pytest.raises(StateError, match="no KV cache .* not a decoder program"):
        method.state
    assert torch.equal(method.execute([torch.ones(2, 3)])[0], torch.ones(2, 3))  # the program still runs
