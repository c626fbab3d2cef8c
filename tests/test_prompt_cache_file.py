"""A prompt cache saved to a file and loaded into a freshly loaded program (etmlx.save_prompt_cache /
load_prompt_cache, llm/decoder/cache_file.py): the next turn's greedy and seeded tokens are those of the whole
conversation computed fresh, its prefill covers only the new tokens (counted from the program's inputs), and a
file is refused by another program, as is a non-cache file."""

from __future__ import annotations

import pytest
import torch

import etmlx
from backends.mlx.llm.decoder import cache_file
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.sampler.config import SamplerConfig
from serve_helpers import eager_model

PROMPT = [5, 17, 42, 9, 77, 3, 120, 64, 8, 2]
MORE = [33, 8, 91, 14]
CONFIG = SamplerConfig(top_k=True, penalties=True, logit_bias=2)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    model, tokenizer = eager_model()
    out = tmp_path_factory.mktemp("prompt_cache_file")
    paths = {}
    for name, pipelined, batch in (("plain", False, 2), ("pipelined", True, 2), ("other", False, 1)):
        paths[name] = out / f"{name}.pte"
        export_decoder(model, paths[name], 64, config=CONFIG, batch=batch, tokenizer=tokenizer, pipelined=pipelined,
                       verify=False)
    return paths


def _counted(model):
    """Record each call's per-row token counts (the `lengths` input) of `model`'s program."""
    calls, execute = [], model.method.execute

    def counting(inputs):
        calls.append(inputs[2].tolist())
        return execute(inputs)

    model.method.execute = counting
    return calls


def _no_eos(model, **sampling):
    return {"logit_bias": {model.meta.eos_token_ids[0]: -100}, **sampling}


@pytest.mark.parametrize("program", ["plain", "pipelined"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7, "top_k": 40, "repetition_penalty": 1.2}],
                         ids=["greedy", "seeded"])
def test_a_cache_loaded_from_a_file_gives_the_fresh_tokens_and_prefills_only_the_new_ones(programs, tmp_path, program,
                                                                                         sampling):
    pte = programs[program]
    model = etmlx.load(pte)
    cache = etmlx.make_prompt_cache(model)
    first = [r.token for r in etmlx.stream_generate(model, PROMPT, 6, prompt_cache=cache, **_no_eos(model, **sampling))]
    path = tmp_path / "conversation.safetensors"
    etmlx.save_prompt_cache(path, cache, metadata={"turns": "1"})

    restored_model = etmlx.load(pte)  # a new program state: only the file knows the conversation
    restored, metadata = etmlx.load_prompt_cache(path, restored_model, return_metadata=True)
    assert metadata == {"turns": "1"}
    assert restored.tokens == PROMPT + first
    calls = _counted(restored_model)
    responses = list(etmlx.stream_generate(restored_model, MORE, 8, prompt_cache=restored,
                                           **_no_eos(model, **sampling)))
    # unpipelined: the last reply token was sampled, never fed; pipelined: fed back to the device too
    held = len(PROMPT) + len(first) - (0 if program == "pipelined" else 1)
    assert responses[-1].cached_tokens == held
    prefill = max(calls[0])  # the row's first call: every token it was not given from the file
    assert prefill == len(PROMPT) + len(first) + len(MORE) - held

    if program == "plain" and sampling:  # the file is plain safetensors: the library reads the same tensors
        safetensors = pytest.importorskip("safetensors.torch")
        entries = safetensors.load_file(str(path))
        assert entries["tokens"].tolist() == PROMPT + first
        ours, _ = cache_file._read_safetensors(path)
        assert len(entries) == len(ours) == 1 + len(restored_model.method.state.buffers)
        assert all(torch.equal(entries[name], ours[name]) for name in entries)
        assert all(entries[f"kv.{k}"].shape[1] == held for k in range(len(ours) - 1))

    fresh_model = etmlx.load(pte)
    fresh = [r.token for r in etmlx.stream_generate(fresh_model, PROMPT + first + MORE, 8,
                                                    **_no_eos(model, **sampling))]
    assert [r.token for r in responses] == fresh


def test_a_file_is_refused_by_another_program(programs, tmp_path):
    model = etmlx.load(programs["plain"])
    cache = etmlx.make_prompt_cache(model)
    list(etmlx.stream_generate(model, PROMPT, 3, prompt_cache=cache))
    path = tmp_path / "c.safetensors"
    etmlx.save_prompt_cache(path, cache)
    with pytest.raises(ValueError, match="saved from another program") as info:
        etmlx.load_prompt_cache(path, etmlx.load(programs["other"]))
    assert "\n" not in str(info.value)
    other = tmp_path / "not-a-cache.safetensors"
    other.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a prompt cache"):
        etmlx.load_prompt_cache(other, model)


def test_ring_programs_are_refused(programs, tmp_path):
    model = etmlx.load(programs["plain"])
    cache = etmlx.make_prompt_cache(model)
    model.meta.ring_cache = True  # as a sliding-window model's export records it
    with pytest.raises(ValueError, match="ring cache"):
        etmlx.save_prompt_cache(tmp_path / "c.safetensors", cache)
