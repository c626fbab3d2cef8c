"""build/etmlx_bench (C++, no Python at run time) times a decoder .pte and a sampler-only .pte and prints consistent
JSON; `make -n setup MLX=cuda13` installs the CUDA build of mlx instead of mlx[cpu]. No wall-clock thresholds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def _expected_allocator() -> str:
    from importlib.metadata import version

    return "mimalloc " + version("cmeel-mimalloc")


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
    # Linked with mimalloc (CMakeLists.txt, ETMLX_MIMALLOC), checked on a live block in the tool itself.
    assert r["allocator"] == (_expected_allocator() if sys.platform == "linux" else "system")
    assert r["decode"]["n"] == 3 * 10 and r["prefill"]["n"] == 2
    assert 0 < r["decode"]["median_ms"] <= r["decode"]["p90_ms"]
    assert abs(r["decode_tokens_per_s"] - 1e3 / r["decode"]["median_ms"]) < 1e-3 * r["decode_tokens_per_s"] + 1e-3
    assert r["warm_first_token_s"] > 0 and r["cold_first_token_s"] > 0
    # Greedy: every run decodes the same tokens, so the sum is a multiple of the run count.
    assert r["token_sum"] % 3 == 0
    # The backend's host-time split of the warm runs' decode calls (runtime/call_profile.h): one backend call per
    # decode step, each phase measured.
    host = r["decode_host"]
    assert host["calls"] == 2 * 10
    assert host["build_ms"] > 0 and host["submit_ms"] > 0 and host["wait_ms"] >= 0 and host["copy_ms"] >= 0
    too_long = _bench(pte, "--prompt-len", 30, "--decode-steps", 20)
    assert too_long.returncode == 2 and "must fit the program's 40 positions" in too_long.stderr


def test_etmlx_dot_writes_the_calls_graph(tmp_path):
    """ETMLX_DOT=FILE: the last call's MLX graph as Graphviz; a decode step of a 1-layer Llama holds its projections
    and its KV-cache writes."""
    import os

    pte = tmp_path / "tiny.pte"
    export_decoder(_tiny(), pte, 40)
    dot = tmp_path / "step.dot"
    done = subprocess.run([str(BENCH), str(pte), "--prompt-len", "4", "--decode-steps", "2", "--runs", "1"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, ETMLX_DOT=str(dot)))
    assert done.returncode == 0, done.stderr
    text = dot.read_text()
    # The projections: MLX's Matmul, or on the CPU one LinearRowCpu node per one-row linear (kernels/cpu_gemm.cpp).
    assert text.startswith("digraph") and text.count('label ="Matmul') + text.count('label ="LinearRowCpu') >= 4
    assert 'label ="ScatterAxis' in text or 'label ="SliceUpdate' in text


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


def test_draft_program_runs_with_every_draft_source(tmp_path):
    """A --draft-tokens program: every --drafts source decodes the plain program's tokens (the bench refuses a run
    that differs); its own greedy continuation as the prediction is accepted in full, K + 1 tokens a call; none
    makes a call per token. The JSON says which source ran and what it drafted."""
    model = _tiny()
    plain, draft = tmp_path / "plain.pte", tmp_path / "draft.pte"
    export_decoder(model, plain, 40)
    export_decoder(model, draft, 40, draft_tokens=4)
    steps, runs = 14, 3
    reference = json.loads(_bench(plain, "--prompt-len", 6, "--decode-steps", steps, "--runs", runs).stdout)
    results = {}
    for source in ("prediction", "ngram", "none"):
        done = _bench(draft, "--prompt-len", 6, "--decode-steps", steps, "--runs", runs, "--drafts", source)
        assert done.returncode == 0, done.stderr
        results[source] = r = json.loads(done.stdout)
        assert r["token_sum"] == reference["token_sum"], source
        assert r["draft"]["source"] == source and r["draft"]["draft_tokens"] == 4
        # Timed: each token's call after the first token's. The program is pipelined (the default), so its first
        # token takes two calls when the prefill carries no drafts, and a token a delivered call already brought
        # costs no call.
        first = 1 if source == "prediction" else 2
        assert r["decode_tokens_per_s"] > 0 and 0 < r["decode"]["n"] <= (runs - 1) * (r["draft"]["calls"] - first)
        if source != "ngram":  # one call per timed token
            assert r["decode"]["n"] == (runs - 1) * (r["draft"]["calls"] - first)
    prediction = results["prediction"]["draft"]
    assert prediction["accepted"] == prediction["proposed"] == steps + 1 - prediction["calls"]
    assert prediction["calls"] == -(-(steps + 1) // 5)
    assert results["none"]["draft"] == {"draft_tokens": 4, "source": "none", "proposed": 0, "accepted": 0,
                                        "calls": steps + 2}  # pipelined: the first token comes with call 2
    bad = _bench(draft, "--drafts", "eagle")
    assert bad.returncode == 2 and "--drafts must be prediction, ngram or none" in bad.stderr


def test_draft_model_and_prompt_ids(tmp_path):
    """--draft-model: a plain program of the same weights drafts for the draft-verifying one (every greedy draft
    right, the plain tokens), its own calls reported; --prompt-ids runs that prompt; sequence_tokens_per_s is
    reported for both kinds of program. The C++ half of `etmlx bench speculative` (benchmarks/speculative_cpp.py)
    runs the same way and checks the tokens."""
    from benchmarks import speculative_cpp

    model = _tiny()
    plain, draft = tmp_path / "plain.pte", tmp_path / "draft.pte"
    export_decoder(model, plain, 40)
    export_decoder(model, draft, 40, draft_tokens=4)
    prompt = "3,9,27,17,51,25"
    reference = json.loads(_bench(plain, "--prompt-ids", prompt, "--decode-steps", 14, "--runs", 3).stdout)
    assert reference["prompt_len"] == 6 and reference["sequence_tokens_per_s"] > 0
    synthetic = json.loads(_bench(plain, "--prompt-len", 6, "--decode-steps", 14, "--runs", 3).stdout)
    assert synthetic["token_sum"] != reference["token_sum"]  # the control: another prompt, other tokens
    done = _bench(draft, "--prompt-ids", prompt, "--decode-steps", 14, "--runs", 3, "--draft-model", plain,
                  "--draft-model-cost", 0)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["token_sum"] == reference["token_sum"] and r["draft"]["source"] == "draft-model"
    assert 0 < r["draft"]["accepted"] == r["draft"]["proposed"]
    assert r["draft_model"]["calls"] > 0 and r["draft_model"]["ms_per_call"] > 0
    assert r["sequence_tokens_per_s"] == r["decode_tokens_per_s"] > 0
    for flags, message in ((["--draft-model-cost", "1"], "--draft-model-cost needs --draft-model"),
                           (["--prompt-ids", "1,x"], "--prompt-ids must be token ids"),
                           (["--prompt-ids", "1,64"], "--prompt-ids must be below the vocabulary size 64")):
        bad = _bench(draft, *flags)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    bad = _bench(plain, "--draft-model", plain)
    assert bad.returncode == 2 and "does not verify drafts" in bad.stderr
    result = speculative_cpp.run(plain, draft, plain, [3, 9, 27, 17, 51, 25], 12, repeats=1)
    assert result["drafts"]["prediction"]["accepted"] == result["drafts"]["prediction"]["proposed"] > 0
    # The draft model here is the target's own plain program: its drafts are all right, but its calls cost what
    # the target's do, so its measured pacing may stop drafting (draft_sources.h DraftModelPacing); the fixed-cost
    # run above shows it drafting.
    assert result["drafts"]["draft-model"]["accepted"] == result["drafts"]["draft-model"]["proposed"]
    assert "draft_model" in result["drafts"]["draft-model"]
    assert result["drafts"]["none"]["proposed"] == 0
    assert all(v > 0 for v in result["speedup"].values())


def test_sampler_only_json(tmp_path):
    from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head
    pte = tmp_path / "head.pte"
    pte.write_bytes(export_sampling_head(LogitsInput(), (torch.zeros(2, 1000),), seeded=True).pte)
    done = _bench(pte, "--calls", 7, "--warmup", 1)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["kind"] == "generic" and r["inputs"] == 3 and r["call"]["n"] == 7
    assert r["allocator"] == (_expected_allocator() if sys.platform == "linux" else "system")
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


def _sampler_with_inputs(tmp_path, batch=2, vocab=1000):
    """A seeded top-k sampler program and its inputs (LM-shaped logits, T=0.8) written as etmlx_bench --inputs
    files; returns (pte, inputs dir, the tokens the Python runtime returns for those inputs)."""
    from benchmarks.gpu_kit import _write_inputs
    from benchmarks.sampler_features import make_logits
    from backends.mlx.llm.sampler.config import SamplerConfig
    from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head, sampler_inputs
    from backends.mlx.runtime.runner import load_method

    config = SamplerConfig(top_k=True)
    pte = tmp_path / "head.pte"
    pte.write_bytes(export_sampling_head(LogitsInput(), (torch.zeros(batch, vocab),), config=config).pte)
    inputs = sampler_inputs(config, [make_logits("lm", batch, vocab, seed=3)], torch.tensor(0.8), torch.tensor(5),
                            top_k=torch.tensor(40))
    _write_inputs(tmp_path / "inputs", inputs)
    expected = load_method(pte.read_bytes()).execute(inputs)[0].tolist()
    return pte, tmp_path / "inputs", expected


def test_inputs_from_files_give_the_python_runtimes_tokens(tmp_path):
    pte, inputs, expected = _sampler_with_inputs(tmp_path)
    done = _bench(pte, "--inputs", inputs, "--calls", 3, "--warmup", 1)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["output0"] == expected
    # Zero-filled inputs (temperature 0, every logit tied) give other tokens: the files were read.
    assert json.loads(_bench(pte, "--calls", 1, "--warmup", 0).stdout)["output0"] != expected
    (inputs / "input_0.bin").write_bytes(b"\0" * 12)
    short = _bench(pte, "--inputs", inputs)
    assert short.returncode == 2 and short.stderr.strip().endswith("input_0.bin has 12 bytes; input 0 takes 8000")
    missing = _bench(pte, "--inputs", tmp_path / "nowhere")
    assert missing.returncode == 2 and "cannot read it" in missing.stderr


def test_etmlx_device_picks_the_device_or_says_why_not(tmp_path):
    import os

    import mlx.core as mx

    pte, inputs, expected = _sampler_with_inputs(tmp_path)

    def on(device):
        return subprocess.run([str(BENCH), str(pte), "--inputs", str(inputs), "--calls", "1", "--warmup", "0"],
                              capture_output=True, text=True, timeout=300, env=dict(os.environ, ETMLX_DEVICE=device))

    cpu = on("cpu")
    assert cpu.returncode == 0 and json.loads(cpu.stdout)["output0"] == expected
    gpu = on("gpu")
    if mx.is_available(mx.gpu):  # a CUDA or Metal build: the same tokens there (docs/cpp-tools.md's GPU figures)
        assert gpu.returncode == 0 and json.loads(gpu.stdout)["output0"] == expected
    else:
        assert gpu.returncode != 0 and "ETMLX_DEVICE=gpu, but this MLX build has no GPU" in gpu.stderr
    bad = on("tpu")
    assert bad.returncode != 0 and 'ETMLX_DEVICE=tpu is not "cpu" or "gpu"' in bad.stderr


def test_gpu_kit_runs_with_the_device_script(tmp_path):
    """`etmlx bench gpu-kit` + benchmarks/gpu_device.py end to end, with the CPU standing in for the GPU: a kit of a tiny
    checkpoint, every item measured, and the engines' tokens compared (same device twice: all equal)."""
    import sys

    from benchmarks import gpu_kit
    from benchmarks import checkpoints as ckpt

    kit = tmp_path / "kit"
    gpu_kit.build(kit, tmp_path / "cache", log=lambda *_: None, size=ckpt.QUICK_SIZE, sampler_shapes=((500, 2),),
                  binaries=True)
    # The kit carries its tools: with its bin/ first on the search path, every library they load is either
    # there, the system's, or MLX's (which the GPU host's own wheel provides).
    import mlx.core

    mlx_lib = Path(mlx.core.__file__).parent / "lib"
    env = dict(os.environ, LD_LIBRARY_PATH=f"{kit / 'bin'}:{mlx_lib}")
    for tool in ("etmlx_bench", "etmlx_decode"):
        ldd = subprocess.run(["ldd", str(kit / "bin" / tool)], capture_output=True, text=True, env=env, check=True)
        for line in ldd.stdout.splitlines():
            if " => /" in line:
                path = line.split(" => ")[1].split(" (")[0]
                assert path.startswith((str(kit / "bin"), "/lib", "/usr/lib")) or "mlx" in path, line
    done = subprocess.run([sys.executable, str(kit / "gpu_device.py"), str(kit), "--devices", "cpu,cpu", "--runs", "1", "--calls", "3", "--json", str(tmp_path / "r.json"), "--dot",
                           str(tmp_path / "dots")], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "r.json").read_text())
    assert [r["kind"] for r in results] == ["decoder"] + ["sampler"] * 3, done.stderr
    decoder = results[0]
    steps = gpu_kit.DECODE_STEPS + 1
    assert decoder["greedy_cpu_gpu_agree"] == decoder["sampled_cpu_gpu_agree"] == steps
    assert decoder["mlx_lm_agree_with_etmlx"] == steps  # mlx-lm on the same integers, greedy
    assert all(r["tokens_cpu_gpu_equal"] and len(r["tokens_cpu"]) == 2 for r in results[1:])
    assert "decoder-int4" in done.stdout and "sampler-topp-v500-b2" in done.stdout
    # The draft-verifying export of the same weights: its own continuation accepted in full, the plain tokens
    # (gpu_device checks their sum), and no drafts without a source.
    for device in ("cpu",):
        spec = decoder[f"speculative_{device}"]
        assert spec["prediction"]["draft"]["accepted"] == spec["prediction"]["draft"]["proposed"] > 0
        assert spec["none"]["draft"]["proposed"] == 0 and spec["prediction"]["tokens_per_s"] > 0
    assert "speculative decoding, K = 8" in done.stdout
    assert spec["prediction"]["decode_host"]["calls"] > 0  # where a verify call's time goes, on each device
    # The mlx-lm directory carries the checkpoint alone: the cached programs beside it would double what travels.
    assert not list((kit / "decoder-int4-mlx").glob("*.pte"))
    # One decode step's graph of each engine, counted by node kind: both run the model's quantized linears.
    graph = decoder["step_graph"]
    for engine in ("etmlx", "mlx_lm"):
        assert graph[engine]["nodes"] == sum(graph[engine]["kinds"].values()) > 0
    assert graph["mlx_lm"]["kinds"]["QuantizedMatmul"] > 0 and "one decode step on cpu" in done.stdout
    # The kit's other script (host-made small arrays against computed ones) runs there with numpy and mlx alone.
    arrays = subprocess.run([sys.executable, str(kit / "gpu_host_arrays.py"), "--rounds", "1", "--iters", "2"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert arrays.returncode == 0, arrays.stderr
    rows = [line for line in arrays.stdout.splitlines() if line.startswith("0 ")]
    assert [row.split()[1] for row in rows] == ["0", "10", "40"], arrays.stdout
    assert all("'host'" in row and "'host8'" in row and "'device'" in row for row in rows)


def test_gpu_kit_binaries_need_a_build(tmp_path):
    """Without the C++ build the kit's binaries are refused with one line saying how to make them."""
    from benchmarks.gpu_binaries import MissingBinary, carried, copy_binaries

    with pytest.raises(MissingBinary, match="make setup"):
        copy_binaries(tmp_path / "bin", root=tmp_path)
    # What travels: ExecuTorch's and OpenBLAS's libraries, not the system's or MLX's (the GPU's own wheel has it).
    assert carried("libexecutorch.so", Path("/x/site-packages/executorch/lib/libexecutorch.so"))
    assert not carried("libc.so.6", Path("/lib/x86_64-linux-gnu/libc.so.6"))
    assert not carried("libmlx.so", Path("/x/site-packages/mlx/lib/libmlx.so"))
    assert not carried("libblas-bd8a282c.so.3", Path("/x/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3"))
