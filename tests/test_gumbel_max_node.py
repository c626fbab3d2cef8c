"""mlx::sample lowers to one GumbelMaxNode, and both kernel variants give the host reference's tokens.

The plain temperature program (no filters, bias, penalties or logprobs) must draw through the
same node as every other sampler program (runtime/kernels/gumbel_max.h), including the
edge cases docs/sampler.md "Sampling semantics" documents: T <= 0 and NaN T are greedy, NaN logits
never win, +inf logits do, T = +inf is uniform over the finite logits. ETMLX_KERNELS=device
runs the GPU formulation (mlx ops) on this CPU build.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backends.mlx.custom_kernel_ops.reference.sample import sample_with_margins
from backends.mlx.exporter.inspect_pte import delegate_blobs
from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head
from backends.mlx.runtime.runner import load_method
from backends.mlx.serialization.generated.node_table import NODE_TAGS
from backends.mlx.serialization.serializer import deserialize

BATCH, VOCAB = 6, 257  # odd vocabulary: the draw's unpaired middle word is used too
SEEDS = (0, 1, 12345, 2**40 + 7)
TEMPERATURES = (0.25, 1.0, 3.0, 0.0, -2.0, math.nan, math.inf)
NEAR_TIE = 1e-4  # reference logs are correctly rounded, the device's are libm's (see reference/sample.py)


def _logits(seed: int) -> torch.Tensor:
    x = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    x[1, ::7] = float("nan")  # NaN never wins
    x[2, 100] = x[2, 200] = float("inf")  # +inf wins, the first of equal ones
    x[3] = float("-inf")  # nothing finite: token 0
    x[4, :5] = float("nan")
    return x


def _node_types(pte) -> list[int]:
    return [i.nodeType for i in deserialize(delegate_blobs(pte)[0]).instructions]


@pytest.fixture(scope="module")
def plain():
    return export_sampling_head(LogitsInput(), (torch.zeros(BATCH, VOCAB),)).pte


@pytest.fixture(scope="module")
def per_row():
    return export_sampling_head(LogitsInput(), (torch.zeros(BATCH, VOCAB),), per_row=True).pte


def _check_against_reference(tokens, logits, temperature, seed):
    expected, margins = sample_with_margins(logits, temperature, seed)
    clear = torch.from_numpy(np.asarray(margins > NEAR_TIE))
    assert torch.equal(tokens[clear], expected[clear]), (temperature, seed, tokens, expected)
    assert int(clear.sum()) >= BATCH - 1  # at most one near-tie row per draw, else the check proves little


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_plain_program_is_one_gumbel_max_node(seeded):
    pte = export_sampling_head(LogitsInput(), (torch.zeros(BATCH, VOCAB),), seeded=seeded).pte
    types = _node_types(pte)
    assert types.count(NODE_TAGS["GumbelMaxNode"]) == 1
    assert NODE_TAGS["RandomBitsNode"] not in types
    node = next(i.node for i in deserialize(delegate_blobs(pte)[0]).instructions
                if i.nodeType == NODE_TAGS["GumbelMaxNode"])
    assert (node.seed is not None) == seeded and node.threshold is None


@pytest.mark.parametrize("kernels", ["cpu", "device"])
def test_plain_program_matches_the_host_reference(plain, monkeypatch, kernels):
    monkeypatch.setenv("ETMLX_KERNELS", kernels)
    method = load_method(plain)
    for seed in SEEDS:
        logits = _logits(seed)
        for t in TEMPERATURES:
            tokens = method.execute([logits, torch.tensor(t), torch.tensor(seed)])[0]
            _check_against_reference(tokens, logits, torch.tensor(t), torch.tensor(seed))
            if not t > 0:  # greedy rows: exactly argmax with NaN as -inf
                assert torch.equal(tokens, torch.nan_to_num(logits, nan=-math.inf).argmax(-1))
            assert int(tokens[2]) == 100 or not t > 0 or t == math.inf
            assert int(tokens[3]) == 0


@pytest.mark.parametrize("kernels", ["cpu", "device"])
def test_per_row_temperatures_and_seeds_match_the_host_reference(per_row, monkeypatch, kernels):
    monkeypatch.setenv("ETMLX_KERNELS", kernels)
    method = load_method(per_row)
    temperature = torch.tensor([0.7, math.nan, 1.5, 0.0, math.inf, -1.0])
    for base in SEEDS:
        seed = torch.arange(BATCH, dtype=torch.int64) * 1000 + base
        logits = _logits(base)
        tokens = method.execute([logits, temperature, seed])[0]
        _check_against_reference(tokens, logits, temperature, seed)
        # A row's draw is its own: alone with batch 1 and its seed it gives the same token.
        alone = [int(sample_with_margins(logits[r:r + 1], temperature[r], seed[r])[0]) for r in range(BATCH)]
        assert tokens.tolist() == alone


@pytest.mark.parametrize("kernels", ["cpu", "device"])
def test_odd_sized_draw_matches_the_host_reference(monkeypatch, kernels):
    # B * V odd: the draw's unpaired middle word falls inside row 1 (the CPU kernel hashes it alone).
    monkeypatch.setenv("ETMLX_KERNELS", kernels)
    method = load_method(export_sampling_head(LogitsInput(), (torch.zeros(3, VOCAB),)).pte)
    for seed in SEEDS:
        logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(seed)) * 0.01
        logits[1, 126:131] = 5.0  # the middle word is token 128's: make it one of five likely winners
        for t in (0.5, 1.0, 2.0):
            tokens = method.execute([logits, torch.tensor(t), torch.tensor(seed)])[0]
            expected, margins = sample_with_margins(logits, torch.tensor(t), torch.tensor(seed))
            clear = torch.from_numpy(np.asarray(margins > NEAR_TIE))
            assert torch.equal(tokens[clear], expected[clear]) and int(clear.sum()) >= 2


def test_unknown_kernel_variant_is_refused(plain, monkeypatch):
    from backends.mlx.runtime.load_errors import LoadError

    monkeypatch.setenv("ETMLX_KERNELS", "gpu")
    # The native log of a failed load is captured into the error (runtime/load_errors.py).
    with pytest.raises(LoadError) as failure:
        load_method(plain)
    assert 'ETMLX_KERNELS=gpu is not "cpu" or "device"' in failure.value.log
