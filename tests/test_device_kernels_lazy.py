"""The device kernel set (ETMLX_KERNELS=device, the formulation Metal and CUDA builds run) gives the CPU set's
tokens on the decode programs, through the Python Decoder and build/etmlx_decode, and both sets build each call's
whole graph before evaluating any of it: ETMLX_CHECK_LAZY=1 counts node outputs materialised before the call's one
evaluation, 0 for either set (the CPU set's host loops are graph nodes). etmlx_lazy_check_control() shows the count
sees an output evaluated early."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from backends.mlx import runtime
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from helpers import tiny_llama

pytestmark = pytest.mark.slow  # decoder exports run on both kernel sets

BINARY = Path(__file__).resolve().parents[1] / "build" / "etmlx_decode"
VOCAB = 300  # more than CANDIDATES, so both sort widths of the filter are exercised
CANDIDATES = 16
PROMPT = [7, 1, 33, 20]
CONFIG = SamplerConfig(top_k=True, top_p=True, min_p=True, candidates=CANDIDATES)

PARAMS = {
    "greedy": SamplingParams(),
    "seeded": SamplingParams(temperature=1.0, seed=11),
    "top_k_top_p": SamplingParams(temperature=1.2, seed=5, top_k=8, top_p=0.9),
    "top_k_wider_than_candidates": SamplingParams(temperature=1.0, seed=3, top_k=40),
    "top_p_alone": SamplingParams(temperature=1.5, seed=9, top_p=0.8),
    "min_p": SamplingParams(temperature=1.0, seed=2, min_p=0.05),
}


@pytest.fixture(scope="module")
def pte(tmp_path_factory) -> Path:
    # Flatter logits, so top-p needs more than CANDIDATES tokens and the sampled runs differ from greedy.
    model = tiny_llama(VOCAB, seed=5, head_scale=0.05)
    out = tmp_path_factory.mktemp("device_kernels") / "tiny.pte"
    export_decoder(model, out, 48, config=CONFIG)
    return out


def _generate(pte, monkeypatch, kernels, params, n=12):
    monkeypatch.setenv("ETMLX_KERNELS", kernels)
    return Decoder(pte).generate(PROMPT, n, params).tokens


@pytest.mark.parametrize("name", list(PARAMS))
def test_device_kernels_give_the_cpu_kernels_tokens(pte, monkeypatch, name):
    cpu = _generate(pte, monkeypatch, "cpu", PARAMS[name])
    assert len(cpu) == 12
    assert _generate(pte, monkeypatch, "device", PARAMS[name]) == cpu


def test_sampled_runs_are_not_greedy(pte, monkeypatch):
    # Otherwise the test above would not check the sampling paths.
    greedy = _generate(pte, monkeypatch, "cpu", PARAMS["greedy"])
    for name in ("seeded", "top_p_alone", "top_k_wider_than_candidates"):
        assert _generate(pte, monkeypatch, "cpu", PARAMS[name]) != greedy, name


def _premature(pte, monkeypatch, kernels, params) -> int:
    lib = runtime.load()
    lib.etmlx_last_call_premature.restype = ctypes.c_int64
    lib.etmlx_checked_calls.restype = ctypes.c_uint64
    monkeypatch.setenv("ETMLX_CHECK_LAZY", "1")
    before = lib.etmlx_checked_calls()
    _generate(pte, monkeypatch, kernels, params, n=2)
    # The prefill and one decode step, all checked; a pipelined program makes one call more (its token 1
    # comes back from step 2).
    assert lib.etmlx_checked_calls() == before + 2 + DecoderMeta.load(pte).pipelined
    return lib.etmlx_last_call_premature()


@pytest.mark.parametrize("kernels", ["device", "cpu"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_kernels_evaluate_once_per_call(pte, monkeypatch, kernels, name):
    assert _premature(pte, monkeypatch, kernels, PARAMS[name]) == 0


def test_the_check_sees_an_early_evaluation():
    # The control: the count the check takes, over a graph with one output evaluated before the rest.
    lib = runtime.load()
    lib.etmlx_lazy_check_control.restype = ctypes.c_int64
    lib.etmlx_last_call_premature.restype = ctypes.c_int64
    last = lib.etmlx_last_call_premature()
    assert lib.etmlx_lazy_check_control() == 1
    assert lib.etmlx_last_call_premature() == last  # the control records nothing


@pytest.mark.parametrize("args", [[], ["--temperature", "1.2", "--seed", "5", "--top-k", "8", "--top-p", "0.9"],
                                  ["--temperature", "1.5", "--seed", "9", "--top-p", "0.8"]])
def test_cpp_decode_loop_device_kernels_match(pte, args):
    def run(kernels):
        done = subprocess.run([str(BINARY), str(pte), "--prompt-ids", "7,1,33,20", "--max-tokens", "12", *args],
                              capture_output=True, text=True, timeout=120, env={"ETMLX_KERNELS": kernels})
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()
    cpu = run("cpu")
    assert len(cpu) == 12 and run("device") == cpu


def _device_step_graph(pte, tmp_path, args) -> str:
    """The last decode call's MLX graph (ETMLX_DOT) of etmlx_decode on the device kernel set."""
    dot = tmp_path / "step.dot"
    done = subprocess.run([str(BINARY), str(pte), "--prompt-ids", "7,1,33,20", "--max-tokens", "3", *args],
                          capture_output=True, text=True, timeout=120,
                          env={"ETMLX_KERNELS": "device", "ETMLX_DOT": str(dot)})
    assert done.returncode == 0, done.stderr[-2000:]
    return dot.read_text()


@pytest.mark.parametrize("args, drawn", [([], False), (["--temperature", "1.2", "--seed", "5"], True),
                                         (["--temperature", "0"], False)], ids=["greedy", "sampled", "zero"])
def test_a_greedy_step_builds_no_noise_on_the_device_kernels(pte, tmp_path, args, drawn):
    """Every row greedy, with a temperature the host holds: the device set's pick is the argmax alone, so a
    GPU's host walks no random bits, sort or threshold on a greedy step (the tokens are checked equal to the
    CPU set's above). A sampled step still draws its noise."""
    graph = _device_step_graph(pte, tmp_path, args)
    assert ('label ="RandomBits"' in graph) == drawn
    assert ('label ="Sort"' in graph) == drawn  # the top-p threshold's sort (CONFIG has top_p)


@pytest.fixture(scope="module")
def draft_pte(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("device_kernels_draft") / "draft.pte"
    export_decoder(tiny_llama(VOCAB, seed=5, head_scale=0.05), out, 48, config=CONFIG, draft_tokens=4)
    return out


@pytest.mark.parametrize("args, drawn", [(["--draft", "none"], False),
                                         (["--draft", "none", "--temperature", "1.2", "--seed", "5"], True)],
                         ids=["greedy", "sampled"])
def test_a_greedy_draft_program_step_builds_no_noise_either(draft_pte, tmp_path, args, drawn):
    """A draft-verifying program spreads each row's temperature over its positions with a gather: the device
    set still sees that the host's temperatures are all greedy, and its step walks no random bits or sort."""
    graph = _device_step_graph(draft_pte, tmp_path, args)
    assert ('label ="RandomBits"' in graph) == drawn
    assert ('label ="Sort"' in graph) == drawn
