"""Small arithmetic on what the host already holds is computed while the graph is built (runtime/host_fold.h).

Checked: a program of index arithmetic over its inputs (what a decode step does with start_pos, lengths and a
draft program's verify input) returns eager torch's values with folding on and off; with folding on, its
graph has none of that arithmetic left (the control, ETMLX_HOST_FOLD=0, keeps all of it), and unset on the CPU
it folds as with =1; arithmetic on a
value the device computes is left to MLX; and a draft program's step without drafts asks MLX for fewer nodes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from backends.mlx.exporter.export import export_to_pte
from helpers import graph_node_kinds

ROOT = Path(__file__).resolve().parents[1]


class _IndexArithmetic(torch.nn.Module):
    """verify [1, G] and lengths [1] as a draft program reads them, and a float input's exact operations."""

    def forward(self, verify, lengths, temperature, x):
        last = lengths - 1
        drafted = torch.minimum((verify >= 0).to(torch.int64).sum(dim=1) - 1, last).clamp(min=0)
        positions = torch.cumsum(torch.ones_like(verify), dim=1) - 1
        index = torch.minimum((last - drafted).unsqueeze(1) + positions, last.unsqueeze(1))
        following = torch.where(positions + 1 < verify.shape[1], positions + 1, torch.zeros_like(positions))
        drafts = torch.where(verify >= 0, verify, torch.zeros_like(verify)).gather(1, following)
        hits = ((drafts == verify) & (positions < drafted.unsqueeze(1))).logical_not().to(torch.int32)
        run = (torch.cumsum(hits, dim=1) == 0).to(torch.int64).sum(dim=1)
        scaled = torch.where(temperature > 0, temperature * 2.0 - 1.0, torch.ones_like(temperature))
        spread = temperature.index_select(0, (positions - positions).reshape(-1))  # a row's knob per position
        device = (x * 3.0).exp().sum()  # needs the device: left to MLX, and what depends on it too
        # Decided whatever the device's value: no position is before a draft when there are none (x and false).
        never = ((device > 0) & (positions < 0)).to(torch.int64).sum()
        # an arange of whole numbers (a proposing program's step offsets): integer and float32
        stepped = lengths.unsqueeze(1) + torch.arange(3, dtype=torch.int64)
        halves = torch.arange(4, dtype=torch.float32) * temperature
        return index, drafts, run, scaled, index.sum() + device.to(torch.int64), spread, never, stepped, halves


_CALL = """
import sys, torch
from backends.mlx.runtime.runner import load_method
pte, out = sys.argv[1], sys.argv[2]
inputs = [torch.tensor([[5, 9, 7, -1, -1]]), torch.tensor([4]), torch.tensor([0.7]), torch.tensor([0.1, 0.2])]
got = load_method(open(pte, "rb").read()).execute(inputs)
torch.save((inputs, [g.clone() for g in got]), out)
"""

_FOLDED = ["CumSum", "Minimum", "Maximum", "GreaterEqual", "GatherAxis", "Gather", "Select", "Equal", "Less",
           "LogicalNot", "Arange"]


def _run(pte: Path, tmp_path: Path, fold: str) -> tuple[list, list, Counter]:
    """fold "": ETMLX_HOST_FOLD unset (the device's default)."""
    dot, saved = tmp_path / f"call-{fold or 'default'}.dot", tmp_path / f"call-{fold or 'default'}.pt"
    env = {"ETMLX_DOT": str(dot), "PATH": "/usr/bin:/bin", **({"ETMLX_HOST_FOLD": fold} if fold else {})}
    done = subprocess.run([sys.executable, "-c", _CALL, str(pte), str(saved)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    inputs, got = torch.load(saved)
    return inputs, got, graph_node_kinds(dot)


def test_index_arithmetic_on_the_hosts_inputs_leaves_the_graph(tmp_path):
    pte = tmp_path / "index.pte"
    example = (torch.tensor([[5, 9, 7, -1, -1]]), torch.tensor([4]), torch.tensor([0.7]), torch.tensor([0.1, 0.2]))
    export_to_pte(_IndexArithmetic().eval(), example).save(pte)
    results = {fold: _run(pte, tmp_path, fold) for fold in ("1", "0", "")}
    for fold, (inputs, got, _) in results.items():
        expected = _IndexArithmetic()(*inputs)
        for g, e in zip(got, expected):
            assert torch.equal(g, e), (fold, g, e)
    on, off = results["1"][2], results["0"][2]
    for kind in _FOLDED:
        assert off[kind] > 0, f"the control has no {kind}: the program no longer tests it"
        assert on[kind] == 0, f"{kind} left in the graph with folding on"
    # What depends on the device's value stays: the exp, its sum and the add after it; an `and` it cannot change
    # does not.
    assert on["Exp"] == off["Exp"] == 1
    ands = lambda kinds: kinds["BitwiseAnd"] + kinds["LogicalAnd"]  # noqa: E731
    assert ands(off) == 2 and ands(on) == 0, (ands(off), ands(on))
    assert sum(on.values()) < sum(off.values()) // 2
    # Unset, a program on the CPU folds (only a CUDA GPU's default is off: host_fold.h).
    assert results[""][2] == on, (results[""][2], on)


@pytest.mark.slow  # a decoder export
def test_a_draft_program_step_without_drafts_asks_for_fewer_nodes(tmp_path):
    from backends.mlx.llm.decoder.export import export_decoder
    from helpers import tiny_llama

    pte = tmp_path / "draft.pte"
    export_decoder(tiny_llama(96, seed=3, head_scale=0.3), pte, 48, draft_tokens=4)
    binary = ROOT / "build" / "etmlx_decode"
    nodes, tokens = {}, {}
    for fold in ("1", "0"):
        dot = tmp_path / f"step-{fold}.dot"
        done = subprocess.run([str(binary), str(pte), "--prompt-ids", "7,1,33,20", "--max-tokens", "12", "--draft",
                               "ngram", "--json"], capture_output=True, text=True, timeout=120,
                              env={"ETMLX_DOT": str(dot), "ETMLX_HOST_FOLD": fold})
        assert done.returncode == 0, done.stderr[-2000:]
        tokens[fold] = json.loads(done.stdout.strip().splitlines()[-1])["tokens"]
        nodes[fold] = sum(graph_node_kinds(dot).values())
    assert tokens["1"] == tokens["0"] and len(tokens["1"]) == 12
    assert nodes["1"] < nodes["0"] - 20, nodes
    print(nodes)


@pytest.mark.slow  # a decoder export
def test_a_proposing_programs_sampled_tokens_index_without_clamping(tmp_path):
    """A --propose-tokens program feeds each step's sampled token to the next step's embedding and each step's
    position to its cache write: the token is an argmax over the vocabulary (in range by construction) and the
    position host arithmetic (an arange folded), so neither asks MLX for the nodes that clamp an index
    (interpreter.cpp normalized_indices: less, add, select, maximum, minimum per index)."""
    from backends.mlx.llm.decoder.export import export_decoder
    from helpers import tiny_llama

    pte = tmp_path / "proposer.pte"
    export_decoder(tiny_llama(96, seed=3, head_scale=0.3), pte, 48, propose_tokens=4)
    dot = tmp_path / "propose.dot"
    done = subprocess.run([str(ROOT / "build" / "etmlx_decode"), str(pte), "--prompt-ids", "7,1,33,20",
                           "--max-tokens", "3", "--json"], capture_output=True, text=True, timeout=120,
                          env={"ETMLX_DOT": str(dot)})
    assert done.returncode == 0, done.stderr[-2000:]
    kinds = graph_node_kinds(dot)
    assert kinds["Gather"] >= 4, kinds  # the dot is a proposing call: four steps' embeddings
    for kind in ("Select", "Less", "Maximum", "Minimum", "Arange"):
        assert kinds[kind] == 0, (kind, kinds)
