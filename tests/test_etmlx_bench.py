"""build/etmlx_bench (C++, no Python at run time) times a decoder .pte and a sampler-only .pte and prints consistent
JSON; `make -n setup MLX=cuda13` installs the CUDA build of mlx instead of mlx[cpu]. No wall-clock thresholds."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backends.mlx.llm.decoder.export import export_decoder

pytestmark = [pytest.mark.bench, pytest.mark.subprocess]  # the C++ etmlx_bench

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "build" / "etmlx_bench"


def _bench(*args):
    done = subprocess.run([str(BENCH), *map(str, args)], capture_output=True, text=True, timeout=300)
    return done


def _tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        eos_token_id=None, bos_token_id=None)).eval()


def test_decoder_json(tmp_path):
    pte = tmp_path / "tiny.pte"
    export_decoder(_tiny(), pte, 40)  # pipelined (the default)
    done = _bench(pte, "--prompt-len", 8, "--decode-steps", 10, "--runs", 3)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["kind"] == "decoder" and r["prompt_len"] == 8 and r["pipelined"] is True
    assert r["decode"]["n"] == 3 * 10 and r["prefill"]["n"] == 2
    assert 0 < r["decode"]["median_ms"] <= r["decode"]["p90_ms"]
    assert abs(r["decode_tokens_per_s"] - 1e3 / r["decode"]["median_ms"]) < 1e-3 * r["decode_tokens_per_s"] + 1e-3
    assert r["warm_first_token_s"] > 0 and r["cold_first_token_s"] > 0
    # Greedy: every run decodes the same tokens, so the sum is a multiple of the run count.
    assert r["token_sum"] % 3 == 0
    too_long = _bench(pte, "--prompt-len", 30, "--decode-steps", 20)
    assert too_long.returncode == 2 and "must fit the program's 40 positions" in too_long.stderr


def test_pipelined_and_unpipelined_decode_the_same_tokens(tmp_path):
    """The same model exported both ways: the same number of timed tokens and the same sampled tokens (their sum),
    each program saying how it was exported."""
    model = _tiny()
    results = {}
    for pipelined in (True, False):
        pte = tmp_path / f"tiny_{pipelined}.pte"
        export_decoder(model, pte, 40, pipelined=pipelined)
        done = _bench(pte, "--prompt-len", 5, "--decode-steps", 12, "--runs", 2, "--temperature", 1, "--seed", 4)
        assert done.returncode == 0, done.stderr
        results[pipelined] = json.loads(done.stdout)
        assert results[pipelined]["pipelined"] is pipelined
    piped, plain = results[True], results[False]
    assert piped["decode"]["n"] == plain["decode"]["n"] == 2 * 12 and piped["prefill"]["n"] == plain["prefill"]["n"] == 1
    assert piped["token_sum"] == plain["token_sum"]
    assert piped["cold_first_token_s"] > 0 and piped["warm_first_token_s"] > 0


def test_sampler_only_json(tmp_path):
    from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head
    pte = tmp_path / "head.pte"
    pte.write_bytes(export_sampling_head(LogitsInput(), (torch.zeros(2, 1000),), seeded=True).pte)
    done = _bench(pte, "--calls", 7, "--warmup", 1)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["kind"] == "generic" and r["inputs"] == 3 and r["call"]["n"] == 7
    assert 0 < r["call"]["median_ms"] <= r["call"]["p90_ms"] and r["first_call_s"] > 0


def test_bad_input_is_one_line():
    done = _bench("/nonexistent.pte")
    assert done.returncode == 2 and done.stderr.strip() == "etmlx_bench: error: /nonexistent.pte: no such file"
    bad = _bench("x.pte", "--runs", "0")
    assert bad.returncode == 2 and "--runs must be an integer >= 1" in bad.stderr


def test_make_setup_mlx_cuda13_installs_the_cuda_wheel():
    out = subprocess.run(["make", "-n", "setup", "MLX=cuda13"], cwd=ROOT, capture_output=True, text=True).stdout
    assert '"mlx[cuda13]==0.32.4"' in out and "grep -v '^mlx\\[cpu\\]' requirements.txt" in out
    cpu = subprocess.run(["make", "-n", "setup"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "cuda" not in cpu.replace(".etmlx-deps-cuda", "")
    bad = subprocess.run(["make", "-n", "setup", "MLX=rocm"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "MLX=rocm is not cpu, cuda12 or cuda13" in bad.stderr
