"""Tensor-parallel programs (llm/distributed/, docs/distributed.md): 2 ranks over the loopback (MLX's ring backend)
decode the tokens of the one-rank program, greedy and seeded, for tiny random Llama and Qwen3, float and int8;
each rank holds about half of the sharded weights; a program is refused by a group of another size, by a rank
holding another rank's file or another export's; a rank killed or stopped mid-run ends the run with one line.

Pipeline-parallel programs (llm/distributed/pipeline.py) of the same models, one layer per rank, decode the one-rank
program's tokens too (greedy and seeded; Llama float and int8, Qwen3, Gemma 3, Qwen3-MoE); each rank holds only its
layers, their KV caches and its end of the model; the refusals; a killed stage ends the run with one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.tensor_parallel import export_tensor_parallel
from backends.mlx.llm.decoder.from_checkpoint import export_checkpoint
from backends.mlx.llm.decoder.pipeline_parallel import export_pipeline_parallel
from backends.mlx.llm.distributed.pipeline import check_pipelinable, split_layers, stage_model
from backends.mlx.llm.distributed.hosts import loopback_hostfile
from backends.mlx.llm.distributed.split_options import NOT_SPLIT_WITH
from free_ports import consecutive_free_ports
from backends.mlx.llm.distributed.rank_files import rank_file
from backends.mlx.llm.decoder.kv_cache import StaticCacheLM
from backends.mlx.llm.distributed.shard import check_shardable, decoder_layers, sharded_paths
from backends.mlx.llm.quantize.affine import quantize_model
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.runtime.load_errors import LoadError
from backends.mlx.runtime.runner import load_method

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 42, 99, 3, 250, 7]
TOKENS = 24
MAX_SEQ_LEN = 64
SEEDED = dict(temperature=1.0, seed=7)


def _model(family: str, quantized: bool):
    import transformers as T

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None)
    configs = {
        "llama": lambda: T.LlamaConfig(**common),
        "qwen3": lambda: T.Qwen3Config(**common, head_dim=32),
        "gemma3": lambda: T.Gemma3TextConfig(**common, head_dim=32, sliding_window=4, query_pre_attn_scalar=32,
                                             layer_types=["sliding_attention", "full_attention"],
                                             tie_word_embeddings=False),
        # every layer's MLP an experts block: the experts stay whole on each rank, the attention is split
        "qwen3moe": lambda: T.Qwen3MoeConfig(**common, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=64),
    }
    torch.manual_seed(3)
    model = T.AutoModelForCausalLM.from_config(configs[family]()).eval()
    with torch.no_grad():  # flatter logits: seeded sampling then differs from greedy (checked)
        model.lm_head.weight.mul_(0.3)
    if quantized:
        quantize_model(model, 8, 64)
    return model


_BUILT: dict = {}


def _programs(name: str, tmp_path_factory):
    """(eager model, one-rank .pte, 2-rank .pte) of a family (-int8: quantized to 8 bits first), built once."""
    if name not in _BUILT:
        family, _, scheme = name.partition("-")
        model = _model(family, scheme == "int8")
        out = tmp_path_factory.mktemp(name)
        one = out / "one.pte"
        export_decoder(model, one, MAX_SEQ_LEN, verify=False)
        tp = out / "tp.pte"
        # The float Llama's export also runs the export's own check (the 2 ranks against the eager model).
        export_tensor_parallel(model, tp, 2, max_seq_len=MAX_SEQ_LEN, verify=name == "llama")
        _BUILT[name] = model, one, tp
    return _BUILT[name]


@pytest.fixture(scope="module", params=["llama", "llama-int8", "qwen3", "qwen3-int8", "gemma3", "qwen3moe"])
def programs(request, tmp_path_factory):
    return _programs(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _programs("llama", tmp_path_factory)


def _etmlx(*args, timeout=120, env=None):
    cmd = [sys.executable, "-m", "etmlx", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _generate_ranks(tp: Path, *flags) -> list[int]:
    done = _etmlx("generate", tp, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", TOKENS, "--json",
                  "--rank-timeout", 60, *flags)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens"]


def _one_rank(one: Path, params: SamplingParams) -> list[int]:
    return [step.token for step in Decoder(one).stream(PROMPT, TOKENS, params, stop_at_eos=False)]


def test_two_ranks_decode_the_one_rank_programs_tokens(programs):
    _, one, tp = programs
    greedy = _one_rank(one, SamplingParams())
    seeded = _one_rank(one, SamplingParams(**SEEDED))
    assert len(greedy) == TOKENS and seeded != greedy  # the seeded run samples: a control the comparison needs
    assert _generate_ranks(tp) == greedy
    # The launcher also checks every rank produced these tokens (each samples from the same logits and seed).
    assert _generate_ranks(tp, "--temperature", 1.0, "--seed", 7) == seeded


def test_generate_runs_the_ranks_where_a_launch_hostfile_says_on_this_machine(llama, tmp_path):
    """mlx.launch's hostfile naming this machine for both ranks (127.0.0.1, localhost): both started here, the
    ring on ports counted up from --starting-port; the one-rank program's tokens."""
    _, one, tp = llama
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},
                                 {"ssh": "localhost", "ips": ["127.0.0.1"]}]))
    greedy = _one_rank(one, SamplingParams())
    assert _generate_ranks(tp, "--hostfile", hosts, "--starting-port", consecutive_free_ports(2)) == greedy


def _rank_processes(code: str, files: list[Path], tmp_path: Path, timeout: float = 60) -> list:
    """Runs `code` (with `path` bound to its file) as len(files) ranks of one ring group over the loopback;
    [(returncode, stdout, stderr)] per rank. A rank still running after `timeout` s is killed (returncode None)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    hosts = loopback_hostfile(len(files), tmp_path)
    procs = []
    for rank, path in enumerate(files):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
        env.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hosts), PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, "-c", f"path = {str(path)!r}\n{code}"], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, out, err))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            results.append((None, out, err))
    return results


LOAD = """
import mlx.core as mx
from backends.mlx.runtime.load_errors import LoadError
from backends.mlx.runtime.runner import load_method
try:
    method = load_method(path)
except LoadError as exc:
    print("refused:", exc)
else:
    print("active", mx.get_active_memory())
"""


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_each_rank_holds_about_half_the_sharded_weights(programs, tmp_path):
    model, one, tp = programs
    (alone,) = _rank_processes(LOAD.replace("import mlx.core", "import os; os.environ.pop('MLX_RANK'); import mlx.core"),
                               [one], tmp_path / "one")
    ranks = _rank_processes(LOAD, [rank_file(tp, 0), rank_file(tp, 1)], tmp_path)
    whole = int(alone[1].split()[-1])
    per_rank = [int(out.split()[-1]) for _, out, _ in ranks]
    # Split in two: the sharded linears (shard.py's paths) and the KV caches; the rest (embedding, head, norms,
    # experts) is replicated on every rank.
    sharded = sum(_bytes(list(layer.get_submodule(path).parameters()) + list(layer.get_submodule(path).buffers()))
                  for layer in decoder_layers(model) for path in sum(sharded_paths(layer), ()))
    caches = _bytes(StaticCacheLM(model, MAX_SEQ_LEN).buffers(recurse=False))  # the KV caches only
    expected = (whole - (sharded + caches) / 2) / whole
    for got in per_rank:
        assert abs(got / whole - expected) < 0.02, (got, whole, expected)
    assert sharded > whole / 4  # a model whose split is visible in the measurement


def test_a_program_of_two_ranks_is_refused_by_a_group_of_one(llama):
    _, _, tp = llama
    with pytest.raises(LoadError, match="runs on 2 ranks but the process's MLX group has 1"):
        load_method(tp)


def test_a_rank_holding_another_ranks_file_is_refused(llama, tmp_path):
    _, _, tp = llama
    results = _rank_processes(LOAD, [rank_file(tp, 0), rank_file(tp, 0)], tmp_path, timeout=30)
    assert "this file is rank 0's part of the program, but this process is rank 1" in results[1][1]


def test_ranks_holding_files_of_two_exports_are_refused(llama, tmp_path_factory, tmp_path):
    model, _, tp = llama
    other = tmp_path_factory.mktemp("other") / "tp.pte"
    export_tensor_parallel(model, other, 2, max_seq_len=MAX_SEQ_LEN, verify=False)  # same weights, another export
    results = _rank_processes(LOAD, [rank_file(tp, 0), rank_file(other, 1)], tmp_path, timeout=30)
    for _, out, _ in results:
        assert "loaded a file of another export" in out


def _rank_child(launcher: subprocess.Popen, rank: int, timeout: float = 60) -> tuple[int, Path]:
    """(pid, rank log directory) of the launcher's rank `rank` once it has loaded its program."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
            try:
                env = dict(item.split("=", 1) for item in
                           Path(f"/proc/{child}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in item)
            except OSError:
                continue
            log = env.get("_ETMLX_RANK_LOG")
            if env.get("MLX_RANK") == str(rank) and log and (Path(log) / f"rank{rank}.log").is_file():
                return int(child), Path(log)
        time.sleep(0.01)
    raise AssertionError(f"rank {rank} never reported ready")


def _kill_or_stop_rank_1(tp: Path, how: str) -> tuple[int, str, float]:
    """`etmlx generate` of the 2-rank program `tp` with rank 1 killed or stopped once loaded: (status, stderr,
    seconds from the signal to the launcher's end)."""
    cmd = [sys.executable, "-m", "etmlx", "generate", str(tp), "--prompt-ids", ",".join(map(str, PROMPT)),
           "--max-tokens", str(MAX_SEQ_LEN - len(PROMPT)), "--rank-timeout", "5"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLX_")}, "PYTHONPATH": str(ROOT),
           "ETMLX_ALLOCATOR": "system"}  # no re-exec: the launcher is the process started here
    launcher = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid, _ = _rank_child(launcher, 1)
        started = time.monotonic()
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    return launcher.returncode, err, time.monotonic() - started


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_rank_that_dies_or_hangs_ends_the_run_with_one_line(llama, how):
    code, err, elapsed = _kill_or_stop_rank_1(llama[2], how)
    assert code != 0
    last = err.strip().splitlines()[-1]
    if how == "kill":
        assert last == "etmlx: error: rank 1 of 2 died (SIGKILL); the run is ended", err
        assert elapsed < 5
    else:
        assert "no rank made progress for 5 s" in last, err
        assert elapsed < 15


def test_models_that_do_not_split_are_refused_by_name():
    import transformers as T

    gpt2 = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="gpt2 models are not sharded yet"):
        check_shardable(gpt2, 2)
    with pytest.raises(ValueError, match="2 key/value heads do not split over 4 ranks"):
        check_shardable(_model("llama", False), 4)


class _Collectives(torch.nn.Module):
    """Rank r scales x by r + 1. Rank 0 sends its value + 1 to rank 1 (send returns what it sent), which receives it
    (a value rank 1 never computes); all_gather stacks the ranks' values in rank order, all_sum adds them."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.scale = float(rank + 1)

    def forward(self, x):
        y = x * self.scale
        passed = torch.ops.mlx.send(y + 1, 1) if self.rank == 0 else torch.ops.mlx.recv_like(y, 0)
        # The collectives take `passed` in (adding zero): every rank runs them after the point-to-point step (a
        # receive has no inputs, so nothing else would order it against them).
        y = y + 0 * passed
        return torch.ops.mlx.all_gather(y, 2), torch.ops.mlx.all_sum(y), passed


def test_collective_nodes_run_over_the_group(tmp_path):
    from backends.mlx.exporter.export import export_to_pte

    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    files = []
    for rank in range(2):
        files.append(export_to_pte(_Collectives(rank), (x,), rank=(rank, 2, "collectives")).save(tmp_path / f"c{rank}.pte"))
    code = ("import torch\nfrom backends.mlx.runtime.runner import run\n"
            "outs = run(path, [torch.arange(6, dtype=torch.float32).reshape(2, 3)])\n"
            "print('OUT', *(out.flatten().tolist() for out in outs))")
    results = _rank_processes(code, files, tmp_path / "hosts")
    for code_, out, err in results:
        assert code_ == 0, err
        line = next(line for line in out.splitlines() if line.startswith("OUT"))
        assert line == "OUT " + " ".join(map(str, [torch.cat([x, 2 * x]).flatten().tolist(), (3 * x).flatten().tolist(),
                                                   (x + 1).flatten().tolist()]))


def test_etmlx_export_writes_a_verified_file_per_rank(tmp_path):
    """The command line: a checkpoint directory, quantized, then sharded; the export runs the ranks to check them."""
    _model("qwen3", False).save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "m.pte"
    done = _etmlx("export", "--model", tmp_path / "ckpt", "--tensor-parallel", 2, "--quantize", "int8",
                  "--max-seq-len", MAX_SEQ_LEN, "--out", out, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "greedy tokens match" in done.stderr and out.is_file() and rank_file(out, 1).is_file()
    bad = _etmlx("export", "--model", tmp_path / "ckpt", "--tensor-parallel", 3, "--out", tmp_path / "b.pte")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == ("etmlx: error: --tensor-parallel 3: the model's 4 attention heads "
                                                   "do not split over 3 ranks")


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_a_draft_verifying_program_splits_and_decodes_the_same_tokens(llama, tmp_path, split):
    """`--draft-tokens K` over 2 ranks: every rank drafts the same tokens from the same history (prompt lookup,
    Predicted Outputs) and verifies them in the same call; the tokens are the plain program's."""
    model, one, _ = llama
    export = export_tensor_parallel if split == "tensor" else export_pipeline_parallel
    spec = tmp_path / "spec.pte"
    export(model, spec, 2, max_seq_len=MAX_SEQ_LEN, draft_tokens=4)  # its check runs the ranks
    prediction = ",".join(map(str, _one_rank(one, SamplingParams())[:8]))
    for flags, params in (((), SamplingParams()),
                          (("--temperature", 1.0, "--seed", 7, "--prediction", prediction), SamplingParams(**SEEDED))):
        done = _etmlx("generate", spec, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", TOKENS, "--json",
                      "--rank-timeout", 60, *flags)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["tokens"] == _one_rank(one, params)
        assert result["draft"]["proposed"] > 0  # drafts were verified (a control: the speculative path ran)
    why = NOT_SPLIT_WITH[f"{split}_parallel"]["propose_tokens"]
    with pytest.raises(ValueError, match=f"^{split}_parallel: {why}$"):
        export(model, tmp_path / "p.pte", 2, max_seq_len=MAX_SEQ_LEN, verify=False, propose_tokens=4)
    refused = _etmlx("generate", spec, "--prompt-ids", "1,2", "--draft-model", one)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].endswith("needs --draft-model-cost C (each rank must choose the "
                                                            "same draft counts)")


_STAGED: dict = {}


def _staged(name: str, tmp_path_factory):
    """(eager model, one-rank .pte, 2-stage .pte): the tensor-parallel tests' models and one-rank programs."""
    if name not in _STAGED:
        model, one, _ = _programs(name, tmp_path_factory)
        pp = one.with_name("pp.pte")
        # The float Llama's export also runs the export's own check (the 2 stages against the eager model).
        export_pipeline_parallel(model, pp, 2, max_seq_len=MAX_SEQ_LEN, verify=name == "llama")
        _STAGED[name] = model, one, pp
    return _STAGED[name]


@pytest.fixture(scope="module", params=["llama", "llama-int8", "qwen3", "gemma3", "qwen3moe"])
def pipeline(request, tmp_path_factory):
    return _staged(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_stages(tmp_path_factory):
    return _staged("llama", tmp_path_factory)


def test_two_stages_decode_the_one_rank_programs_tokens(pipeline):
    _, one, pp = pipeline
    greedy = _one_rank(one, SamplingParams())
    seeded = _one_rank(one, SamplingParams(**SEEDED))
    assert seeded != greedy  # the seeded run samples: a control the comparison needs
    assert _generate_ranks(pp) == greedy
    # The launcher also checks both ranks produced these tokens (each samples from the all-summed logits).
    assert _generate_ranks(pp, "--temperature", 1.0, "--seed", 7) == seeded


def _module_bytes(module) -> int:
    return _bytes(list(module.parameters()) + list(module.buffers()))


def test_each_stage_holds_its_layers_and_its_end_only(llama_stages, tmp_path):
    model, one, pp = llama_stages
    (alone,) = _rank_processes(LOAD.replace("import mlx.core", "import os; os.environ.pop('MLX_RANK'); import mlx.core"),
                               [one], tmp_path / "one")
    ranks = _rank_processes(LOAD, [rank_file(pp, 0), rank_file(pp, 1)], tmp_path)
    whole = int(alone[1].split()[-1])
    per_rank = [int(out.split()[-1]) for _, out, _ in ranks]
    layers = decoder_layers(model)
    cache = StaticCacheLM(model, MAX_SEQ_LEN)
    held = [_module_bytes(layers[i]) + _bytes(cache.layer_cache(i)) for i in range(len(layers))]
    blocks = split_layers(len(layers), 2)
    # What each rank does not hold: the other rank's layers and caches, and the other end of the model.
    missing = [sum(held[i] for i in blocks[1]) + _module_bytes(model.model.norm) + _module_bytes(model.lm_head),
               sum(held[i] for i in blocks[0]) + _module_bytes(model.model.embed_tokens)]
    for got, gone in zip(per_rank, missing):
        assert abs(got - (whole - gone)) / whole < 0.02, (got, whole, gone)
    assert min(missing) > whole / 4  # a model whose split is visible in the measurement


def test_a_stage_killed_mid_run_ends_the_run_with_one_line(llama_stages):
    code, err, elapsed = _kill_or_stop_rank_1(llama_stages[2], "kill")
    assert code != 0
    assert err.strip().splitlines()[-1] == "etmlx: error: rank 1 of 2 died (SIGKILL); the run is ended", err
    assert elapsed < 5


def test_layers_split_in_contiguous_blocks_the_earlier_ranks_taking_the_remainder():
    assert split_layers(3, 2) == [range(0, 2), range(2, 3)]
    assert split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    import transformers as T

    config = T.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                                layer_types=["full_attention", "full_attention", "sliding_attention"])
    model = T.AutoModelForCausalLM.from_config(config).eval()
    last = stage_model(model, 1, 2)
    # The stage's one layer is the model's third, renumbered 0 with its layer type; its weights are shared.
    assert len(decoder_layers(last)) == 1 and last.config.layer_types == ["sliding_attention"]
    assert decoder_layers(last)[0].self_attn.layer_idx == 0
    assert decoder_layers(last)[0].mlp.up_proj.weight is decoder_layers(model)[2].mlp.up_proj.weight
    assert len(decoder_layers(model)) == 3 and model.config.num_hidden_layers == 3  # the model is left as it was
    assert len(decoder_layers(stage_model(model, 0, 2))) == 2


def test_what_does_not_split_into_stages_is_refused_in_one_line(tmp_path):
    import transformers as T
    from types import SimpleNamespace

    gpt2 = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="^pipeline_parallel: gpt2 models are not split yet"):
        check_pipelinable(gpt2, 2)
    with pytest.raises(ValueError, match="^pipeline_parallel 3: the model has 2 decoder layers, fewer than the ranks$"):
        check_pipelinable(_model("llama", False), 3)
    with pytest.raises(ValueError, match="^pipeline_parallel: vision-language models are not split yet$"):
        check_pipelinable(SimpleNamespace(config=SimpleNamespace(vision_config=object())), 2)
    # Refused before the checkpoint is read (none is there).
    for options, message in ((dict(tensor_parallel=2), "not built together with tensor_parallel yet"),
                             (dict(propose_tokens=4), "not built with propose_tokens yet")):
        with pytest.raises(ValueError, match=f"^pipeline_parallel: {message}"):
            export_checkpoint(tmp_path / "absent", tmp_path / "m.pte", pipeline_parallel=2, **options)
    done = _etmlx("export", "--model", tmp_path / "absent", "--pipeline-parallel", 2, "--tensor-parallel", 2)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == ("etmlx: error: --pipeline-parallel: not built together with "
                                                    "--tensor-parallel yet (choose one)")
