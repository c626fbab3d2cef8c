"""A long prompt is prefilled in calls of at most `prefill_chunk` tokens (runtime/decode_rows.h RowRequest), so its
activations are a chunk's, not the prompt's: the Python loop and the C++ etmlx_decode decode the eager model's greedy
tokens whatever the chunk (1 token, one that does not divide the prompt, the whole prompt, 0 = one call), pipelined
or not, with the calls the chunks ask for; seeded sampling draws the same tokens chunked or not; programs whose
calls a chunk would change (drafts, proposals) prefill whole; penalty counts (reset by every chunk) end as a whole
prefill leaves them; and a long prompt's peak memory falls with the chunk."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backends.mlx.llm.decoder.decode_rows import checked_prefill_chunk
from backends.mlx.runtime.decode_rows_lib import RowsCore
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.runtime.native_tools import tool_path

PROMPT_LEN = 150
STEPS = 8


def _model(intermediate: int = 128) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=intermediate,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, max_position_embeddings=4096, eos_token_id=None,
                                        bos_token_id=None, tie_word_embeddings=False)).eval()


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    model = _model()
    folder = tmp_path_factory.mktemp("chunks")
    prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        eager = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS)
    paths = {}
    for pipelined in (True, False):
        paths[pipelined] = folder / f"p{int(pipelined)}.pte"
        export_decoder(model, paths[pipelined], 256, pipelined=pipelined)
    return SimpleNamespace(paths=paths, prompt=prompt, eager=eager[0, PROMPT_LEN:].tolist())


def _cpp(pte, prompt, *flags) -> subprocess.CompletedProcess:
    return subprocess.run([str(tool_path("etmlx_decode")), str(pte), "--prompt-ids", ",".join(map(str, prompt)),
                           "--max-tokens", str(STEPS), "--json", *map(str, flags)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("pipelined", [True, False])
def test_the_python_loop_decodes_the_eager_tokens_in_chunks(programs, pipelined):
    for chunk in (0, 1, 37, PROMPT_LEN, PROMPT_LEN + 1):
        decoder = Decoder(programs.paths[pipelined], prefill_step_size=chunk)
        calls, execute = [0], decoder.method.execute

        def counted(*args, **kwargs):
            calls[0] += 1
            return execute(*args, **kwargs)

        decoder.method.execute = counted
        tokens = [s.token for s in decoder.stream(programs.prompt, STEPS, SamplingParams(), stop_at_eos=False)]
        assert tokens == programs.eager, chunk
        prefill_calls = math.ceil(PROMPT_LEN / chunk) if chunk else 1
        # a pipelined program's last token comes with one more call
        assert calls[0] == prefill_calls + STEPS - 1 + int(pipelined), chunk


@pytest.mark.parametrize("pipelined", [True, False])
def test_etmlx_decode_decodes_the_eager_tokens_in_chunks(programs, pipelined):
    for chunk in (1, 37, 0):
        done = _cpp(programs.paths[pipelined], programs.prompt, "--prefill-step-size", chunk)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.splitlines()[-1])["tokens"] == programs.eager, chunk


def test_sampled_tokens_do_not_depend_on_the_chunk(programs):
    runs = {}
    for chunk in (0, 37):
        done = _cpp(programs.paths[True], programs.prompt, "--prefill-step-size", chunk, "--temperature", 1, "--seed", 5)
        assert done.returncode == 0, done.stderr
        runs[chunk] = json.loads(done.stdout.splitlines()[-1])["tokens"]
        decoder = Decoder(programs.paths[True], prefill_step_size=chunk)
        params = SamplingParams(temperature=1.0, seed=5)
        assert [s.token for s in decoder.stream(programs.prompt, STEPS, params, stop_at_eos=False)] == runs[chunk]
    assert runs[0] == runs[37]
    assert runs[0] != programs.eager  # control: the draws are not the greedy tokens


def test_programs_whose_calls_a_chunk_would_change_prefill_whole():
    """The decode-step rules (decode_rows.cpp start(), every loop's) feed a 100-token prompt in chunks of 64 to a
    plain program, whole to a draft-verifying or proposing one."""
    def first_call(**program) -> int:
        core = RowsCore(1, 256, ring=False, prompt_cache=False, pipelined=False, eos=[], copies=False, **program)
        core.start(0, list(range(1, 101)), 4, True, None, 0, False, False, prefill_chunk=64)
        tokens, _ = core.layout()
        return len(tokens[0])

    assert first_call(draft_tokens=0) == 64
    assert first_call(draft_tokens=3) == 100
    assert first_call(draft_tokens=0, propose_tokens=4) == 100
    assert checked_prefill_chunk(64) == 64
    with pytest.raises(ValueError, match="prefill_step_size must be >= 0"):
        checked_prefill_chunk(-1)


def _generate(pte, prompt, *flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "etmlx", "generate", str(pte), "--prompt-ids",
                           ",".join(map(str, prompt)), "--max-tokens", str(STEPS), "--json", *map(str, flags)],
                          capture_output=True, text=True, timeout=300)


def test_etmlx_generate_takes_the_step_size(programs):
    done = _generate(programs.paths[True], programs.prompt, "--prefill-step-size", 37)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["tokens"] == programs.eager


def test_a_bad_chunk_is_refused_in_one_line(programs):
    done = _cpp(programs.paths[True], programs.prompt, "--prefill-step-size", "-2")
    assert done.returncode == 2
    assert "--prefill-step-size must be an integer >= 0, got '-2'" in done.stderr
    done = _generate(programs.paths[True], programs.prompt, "--prefill-step-size", "-2")
    assert done.returncode != 0
    assert "prefill_step_size must be >= 0" in done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr


CPP_PEAK = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


@pytest.mark.subprocess
def test_a_long_prompt_peaks_lower_in_chunks(tmp_path):
    """A 3,000-token prompt through a model whose MLP is 4,096 wide: one call holds [3000, 4096] float32
    activations (47 MiB each); chunks of 128 hold 2 MiB."""
    pte = tmp_path / "wide.pte"
    export_decoder(_model(intermediate=4096), pte, 3072, verify=False)
    prompt = ",".join(str(i % 256) for i in range(3000))

    def peak(chunk: int) -> int:
        cmd = [str(tool_path("etmlx_decode")), str(pte), "--prompt-ids", prompt, "--max-tokens", "2",
               "--prefill-step-size", str(chunk)]
        runs = [subprocess.run([sys.executable, "-c", CPP_PEAK, *cmd], capture_output=True, text=True, timeout=300)
                for _ in range(2)]
        assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
        return min(int(r.stdout.strip().splitlines()[-1]) for r in runs)

    whole, chunked = peak(0), peak(128)
    assert whole - chunked > 60 << 20, (whole >> 20, chunked >> 20)


def test_etmlx_serve_refuses_a_negative_step_size():
    from backends.mlx.serve.app import ServeLimits

    ServeLimits(prefill_step_size=0).check()
    with pytest.raises(ValueError, match="--prefill-step-size must be >= 0, got -1"):
        ServeLimits(prefill_step_size=-1).check()


def test_penalty_counts_end_as_a_whole_prefill_leaves_them(tmp_path):
    """Each chunk resets the counts, so no dropped chunk token is counted: strong penalties draw the same tokens
    chunked or not (control: the penalties change the draws; a chunk's token counted changed them too, checked)."""
    from backends.mlx.llm.sampler.config import SamplerConfig

    pte = tmp_path / "penalties.pte"
    export_decoder(_model(), pte, 256, config=SamplerConfig(penalties=True), verify=False)
    prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2)).tolist()
    penalised = ("--temperature", 0.7, "--seed", 3, "--presence-penalty", 2, "--frequency-penalty", 2)
    runs = {}
    for chunk, knobs in ((0, penalised), (37, penalised), (1, penalised), (0, penalised[:4])):
        done = _cpp(pte, prompt, "--prefill-step-size", chunk, "--max-tokens", 24, *knobs)
        assert done.returncode == 0, done.stderr
        runs[chunk, len(knobs)] = json.loads(done.stdout.splitlines()[-1])["tokens"]
        if len(knobs) == len(penalised) and chunk:
            params = SamplingParams(temperature=0.7, seed=3, presence_penalty=2.0, frequency_penalty=2.0)
            decoder = Decoder(pte, prefill_step_size=chunk)
            assert [s.token for s in decoder.stream(prompt, 24, params, stop_at_eos=False)] == runs[chunk, len(knobs)]
    assert runs[37, 8] == runs[0, 8] == runs[1, 8]
    assert runs[0, 4] != runs[0, 8]  # control: the penalties change the draws


def test_a_waiting_request_counts_a_busy_rows_prefill_chunks():
    """Prefix affinity weighs the steps a busy row has left before it holds the prefix: every chunk is a call."""
    from backends.mlx.llm.decoder.decode_rows import DecodeRows
    from backends.mlx.llm.decoder.meta import DecoderMeta
    from backends.mlx.llm.sampler.config import SamplerConfig
    from backends.mlx.serve.engine import EngineRequest

    meta = DecoderMeta.build(max_seq_len=32, vocab_size=50, batch=2, eos_token_ids=[0], seeded=True,
                             config=SamplerConfig(), dtype="float32", pipelined=False, ring_cache=False)
    prompt = [3, 4, 5, 6, 7, 8, 9]
    for chunk, prefill_calls in ((3, 3), (0, 1)):
        rows = DecodeRows(meta, prefill_chunk=chunk)
        rows.start(0, EngineRequest(prompt, SamplingParams(), 5, lambda _: None), reuse=False)
        assert rows.busy_prefix(prompt + [1]) == (0, 7, 5 + prefill_calls)
