"""`etmlx export` of an mlx-lm 4-bit directory grows its peak RSS by at most 1.3x the weights it adds, and
`etmlx export --quantize int4` of a bfloat16 checkpoint by at most 1.5x.

Two random packed directories (benchmarks/packed_checkpoint.py, bfloat16 scales, as mlx-community publishes them)
differ only in their number of layers; each is exported (with its verification) by the `etmlx` command in a child
process, and the peak RSS of the two (GNU time's maximum resident set size) is compared: the difference over the
difference of their safetensors bytes is what each weight byte costs the export, with what does not grow with
the weights (the interpreter, torch, the vocabulary-sized head's blocks) subtracted, as measured in the same run.
Issue 51's target is 1.3x the weights at 8B, where that fixed part is small. Before the export read the weights
in place (lowering cloned every weight, the named data held another copy, and the eager model's pages stayed
resident while the written program loaded its own copy) this ratio was 3.08; then 1.18-1.46 (the check's eager
forward read every page back while the runtime's freed memory was still held, more or less by the host's load);
now 0.87-0.89, idle or beside two busy loops (each module's pages given back after its forward, 2026-11-29). The
control: a child that reads the same files and copies them once must exceed the bound, so the measurement sees a
copy of the weights.

The bfloat16 case: two random bfloat16 checkpoints (benchmarks/bf16_checkpoint.py) differing only in their layer
count, exported with `--quantize int4`; issue 51's target is 1.5x the checkpoint's bytes. Loading the checkpoint
whole through transformers (float32, twice the bytes) and quantizing it after was 3.16x at 1.5B; each tensor is now
read and quantized alone (llm/quantize/streamed.py). The control is that whole-model load in a child, which must
exceed the bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bf16_checkpoint as bf16
from benchmarks import checkpoints as ckpt
from benchmarks import packed_checkpoint as packed

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

BOUND = 1.3  # issue 51: export peak RSS <= 1.3x the weights of an mlx-lm directory
BF16_BOUND = 1.5  # issue 51: --quantize export peak RSS <= 1.5x a bfloat16 checkpoint's weights
# Llama-3.2-1B's layer (34 MB at 4 bits) under a small vocabulary: the layers dominate what differs.
LAYER = dict(vocab_size=4096, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
             num_key_value_heads=8)
FEW, MANY = 2, 10
# A smaller layer (30 MB in bfloat16) for the --quantize case, whose export also quantizes.
BF16_LAYER = dict(vocab_size=4096, hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                  num_key_value_heads=4)
BF16_FEW, BF16_MANY = 2, 6
ETMLX = Path(sys.executable).parent / "etmlx"
TIME = Path("/usr/bin/time")
# The weights read into memory and copied once, both held: what the export did before (about 2x here).
COPY = ("import sys, pathlib\n"
        "read = [f.read_bytes() for f in sorted(pathlib.Path(sys.argv[1]).glob('*.safetensors'))]\n"
        "copied = [bytearray(b) for b in read]")
# The --quantize path before: transformers loads the whole checkpoint as float32, then every layer is quantized.
WHOLE = ("import sys, torch\n"
         "from transformers import AutoModelForCausalLM\n"
         "from backends.mlx.llm.quantize.affine import quantize_model\n"
         "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)\n"
         "quantize_model(model, 4, 64, stored=torch.bfloat16)")


def _peak_rss(command: list[str]) -> int:
    """The command's peak RSS, by GNU time: a child's ru_maxrss read here with wait4 would start from this
    process's own (Linux keeps the larger of the forked parent's and the exec'd program's), time's child from
    time's few MB."""
    assert TIME.is_file(), "/usr/bin/time (GNU time) is needed to measure the peak RSS"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([str(TIME), "-f", "%M", *command], capture_output=True, text=True, env=env, timeout=1100)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return int(done.stderr.strip().splitlines()[-1]) * 1024


def _directory(tmp_path: Path, layers: int) -> Path:
    spec = ckpt.CheckpointSpec(**LAYER, num_hidden_layers=layers)
    return packed.cached(spec, tmp_path / "checkpoints")


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    root = tmp_path_factory.mktemp("export-memory")
    return root, _directory(root, FEW), _directory(root, MANY)


@pytest.fixture(scope="module")
def bf16_directories(tmp_path_factory):
    root = tmp_path_factory.mktemp("export-memory-bf16")
    return root, *(bf16.cached(ckpt.CheckpointSpec(**BF16_LAYER, num_hidden_layers=n), root)
                   for n in (BF16_FEW, BF16_MANY))


def _ratio(directories, command) -> tuple[float, int]:
    """Peak-RSS growth per weight byte added."""
    _, few, many = directories
    added = packed.weight_bytes(many) - packed.weight_bytes(few)
    return (_peak_rss(command(many)) - _peak_rss(command(few))) / added, added


@pytest.mark.timeout(1200)
def test_export_peak_rss_grows_by_at_most_the_target_times_the_weights(directories):
    root = directories[0]
    ratio, added = _ratio(directories, lambda d: [str(ETMLX), "export", "--model", str(d), "--out",
                                                  str(root / f"{d.name}.pte"), "--max-seq-len", "64"])
    print(f"mlx directory export: {ratio:.2f}x the {added / 1e6:.0f} MB added")
    assert added > 250e6
    assert ratio <= BOUND, (f"export peak RSS grew {ratio:.2f}x the {added / 1e6:.0f} MB of weights added "
                            f"(bound {BOUND})")


def test_a_copy_of_the_weights_exceeds_the_bound(directories):
    ratio, _ = _ratio(directories, lambda d: [sys.executable, "-c", COPY, str(d)])
    assert ratio > BOUND, f"holding the mapped weights and a copy grew only {ratio:.2f}x: the measure misses a copy"


@pytest.mark.timeout(600)
def test_quantizing_a_bf16_checkpoint_grows_by_at_most_the_target_times_its_weights(bf16_directories):
    root = bf16_directories[0]
    ratio, added = _ratio(bf16_directories, lambda d: [str(ETMLX), "export", "--model", str(d), "--quantize", "int4",
                                                       "--out", str(root / f"{d.name}.pte"), "--max-seq-len", "32"])
    print(f"bf16 --quantize int4: {ratio:.2f}x the {added / 1e6:.0f} MB added")
    assert added > 100e6
    assert ratio <= BF16_BOUND, (f"--quantize int4 export peak RSS grew {ratio:.2f}x the {added / 1e6:.0f} MB of "
                                 f"bfloat16 weights added (bound {BF16_BOUND})")


def test_loading_the_bf16_checkpoint_whole_exceeds_the_bound(bf16_directories):
    ratio, _ = _ratio(bf16_directories, lambda d: [sys.executable, "-c", WHOLE, str(d)])
    print(f"whole float32 load: {ratio:.2f}x")
    assert ratio > BF16_BOUND, f"the whole float32 model grew only {ratio:.2f}x: the measure misses the float copy"
