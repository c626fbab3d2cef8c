"""On the CPU, the knobs a call hands the sampler add no graph nodes (kernels/host_kernel.h host_rows).

A sampling step's temperature, seed, top-k, top-p and min-p are the call's inputs: the host holds them. The CPU
kernel set used to spread each over the rows through MLX (reshape, broadcast, contiguous; where(T > 0) for the
filter's temperature) and to pass the logits and the threshold through contiguous copies: about 20 graph nodes,
each a task on the CPU stream, around two host loops. Now those operands are made on the host, and the loops read
the logits and the threshold flat where they lie.

Checked: a per-row sampler with every filter on is a graph of its two host loops (and at most a view of the logits),
against the device formulation on the same CPU (ETMLX_KERNELS=device, the control) which keeps its nodes; and its
tokens, greedy and sampled, are those of the device formulation, row by row.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head, sampler_inputs
from helpers import graph_node_kinds

ROOT = Path(__file__).resolve().parents[1]
BATCH, VOCAB = 4, 300
CONFIG = SamplerConfig(top_k=True, top_p=True, min_p=True)

_CALL = """
import sys, torch
from backends.mlx.runtime.runner import load_method
pte, saved, out = sys.argv[1:4]
tokens = load_method(open(pte, "rb").read()).execute(torch.load(saved))[0]
torch.save(tokens.clone(), out)
"""


def _inputs(temperature: list[float]) -> list:
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    return sampler_inputs(CONFIG, [logits], torch.tensor(temperature), torch.tensor([3, 5, 7, 11]),
                          top_k=torch.tensor([0, 20, 5, 40]), top_p=torch.tensor([1.0, 0.9, 0.5, 0.95]),
                          min_p=torch.tensor([0.0, 0.05, 0.0, 0.1]))


def _run(pte: Path, inputs: list, kernels: str, tmp_path: Path, name: str):
    saved, out, dot = tmp_path / f"{name}.in", tmp_path / f"{name}.out", tmp_path / f"{name}.dot"
    torch.save(inputs, saved)
    done = subprocess.run([sys.executable, "-c", _CALL, str(pte), str(saved), str(out)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT,
                          env={"ETMLX_DOT": str(dot), "ETMLX_KERNELS": kernels, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(out), graph_node_kinds(dot)


def test_the_calls_knobs_add_no_nodes_and_the_tokens_stay(tmp_path):
    pte = tmp_path / "sampler.pte"
    pte.write_bytes(export_sampling_head(LogitsInput(), (torch.zeros(BATCH, VOCAB),), config=CONFIG,
                                         per_row=True).pte)
    for name, temperature in (("sampled", [0.8, 1.0, 0.0, 1.3]), ("greedy", [0.0, 0.0, 0.0, 0.0])):
        inputs = _inputs(temperature)
        cpu_tokens, cpu = _run(pte, inputs, "cpu", tmp_path, f"cpu-{name}")
        device_tokens, device = _run(pte, inputs, "device", tmp_path, f"device-{name}")
        assert torch.equal(cpu_tokens, device_tokens), (name, cpu_tokens, device_tokens)
        assert cpu["GumbelMaxCpu"] == 1, cpu
        for kind in ("Contiguous", "Broadcast", "Select", "Greater"):
            assert cpu[kind] == 0, (name, kind, cpu)
        assert sum(cpu.values()) <= 3, cpu  # the two loops, and at most a view of the logits
        assert sum(device.values()) >= sum(cpu.values()) + 4, (cpu, device)  # the control keeps its nodes
    assert len(set(cpu_tokens.tolist())) > 1
