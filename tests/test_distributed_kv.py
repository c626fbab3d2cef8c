"""A quantized KV cache (`--kv-bits`) in split programs: each rank stores its own heads' (tensor parallel) or its
own layers' (pipeline parallel) cache quantized, and the 2-rank programs decode the one-rank `--kv-bits 4`
program's tokens, greedy and seeded. Gemma 3 (sliding-window rings beside full layers), head size 32, group 32.
The tensor-parallel export runs its own check against the eager model over the same quantized cache."""

from __future__ import annotations

import pytest

from backends.mlx.exporter.inspect_pte import TAG_NAMES, delegate_blobs
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.decoder.pipeline_parallel import export_pipeline_parallel
from backends.mlx.llm.decoder.rank_programs import rank_tokens
from backends.mlx.llm.decoder.tensor_parallel import export_tensor_parallel
from backends.mlx.llm.distributed.rank_files import rank_file
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.serialization.serializer import deserialize
from test_distributed import MAX_SEQ_LEN, PROMPT, SEEDED, _model

pytestmark = pytest.mark.subprocess

TOKENS = 16
KV = dict(kv_bits=4, kv_group_size=32)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    model = _model("gemma3", False)
    out = tmp_path_factory.mktemp("kv")
    one = out / "one.pte"
    export_decoder(model, one, MAX_SEQ_LEN, verify=False, **KV)
    return model, one, out


def _attention_kinds(pte) -> list[str]:
    """The SDPA node kinds of a program's delegate graphs, in order."""
    return [TAG_NAMES[ins.nodeType] for blob in delegate_blobs(pte.read_bytes())
            for ins in deserialize(blob).instructions if TAG_NAMES.get(ins.nodeType, "").endswith("SdpaNode")]


def _tokens(pte, params: SamplingParams) -> list[int]:
    return [step.token for step in Decoder(pte).stream(PROMPT, TOKENS, params, stop_at_eos=False)]


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_two_ranks_with_a_4_bit_cache_decode_the_one_rank_programs_tokens(gemma3, split):
    model, one, out = gemma3
    pte = out / f"{split}.pte"
    export = export_tensor_parallel if split == "tensor" else export_pipeline_parallel
    export(model, pte, 2, max_seq_len=MAX_SEQ_LEN, verify=split == "tensor", **KV)
    layers = [2, 2] if split == "tensor" else [1, 1]  # every layer's heads split, or one layer per stage
    for rank in range(2):
        meta = DecoderMeta.load(rank_file(pte, rank))
        assert (meta.kv_bits, meta.kv_group_size, meta.ranks) == (4, 32, 2)
        # each rank attends over its own quantized cache (a float cache's layers would be SdpaNode)
        assert _attention_kinds(rank_file(pte, rank)) == ["QuantizedSdpaNode"] * layers[rank]
    greedy = _tokens(one, SamplingParams())
    assert rank_tokens(pte, PROMPT, TOKENS) == greedy
    seeded = _tokens(one, SamplingParams(**SEEDED))
    assert seeded != greedy  # the seeded run samples: a control the comparison needs
    assert rank_tokens(pte, PROMPT, TOKENS, extra=("--temperature", "1.0", "--seed", "7")) == seeded
