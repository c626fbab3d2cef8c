"""Cross-row reuse (decode_rows.py): a request whose prompt starts with a prefix another row holds (busy or free)
gets it copied into its own row inside the program's state and prefills only the rest. Tokens are those of
the same requests without any prompt cache (greedy and seeded, pipelined and not), 12 requests sharing a
prefix submitted together over 4 rows compute about the unique prompt tokens (and, without copies, several times
them: the measure can tell), and a copy that fails costs its request the reuse, not its tokens."""

from __future__ import annotations

import threading

import pytest
import torch

from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.decoder.decode_rows import common_prefix
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.runtime.runner import load_method
from backends.mlx.serve.engine import Engine, EngineRequest
from serve_helpers import eager_model

PREFIX = [2 + (i * 7) % 250 for i in range(140)]  # past AFFINITY_MIN_TOKENS: requests wait for its prefill
REQUESTS = 12


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    model, tokenizer = eager_model()
    out = tmp_path_factory.mktemp("cross_row")
    paths = {}
    for pipelined in (False, True):
        paths[pipelined] = out / f"tiny-{pipelined}.pte"
        export_decoder(model, paths[pipelined], 192, batch=4, tokenizer=tokenizer, pipelined=pipelined,
                       config=SamplerConfig(top_k=True, logit_bias=1), verify=False)
    return paths


class _NoCopies:
    """The loaded method without its state access: the engine's rows then share no entries."""

    def __init__(self, method):
        self.execute = method.execute


def _serve(program, meta, prompts, sampling, **options):
    engine = Engine(program, meta, **options).start()
    done = threading.Semaphore(0)
    outputs = [[] for _ in prompts]

    def sink(i):
        def take(event):
            if event.token is not None:
                outputs[i].append(event.token)
            if event.finish_reason:
                done.release()
        return take

    requests = [EngineRequest(p, SamplingParams(**sampling(i)), 6, sink(i)) for i, p in enumerate(prompts)]
    try:
        engine.submit_all(requests)
        for _ in requests:
            assert done.acquire(timeout=300)
    finally:
        engine.stop()
    prefilled = sum(len(r.prompt) - r.cached_tokens for r in requests)
    return outputs, prefilled


def _unique(prompts):
    ordered = sorted(prompts)
    return sum(len(p) - (common_prefix(p, q) if q else 0) for p, q in zip(ordered, [None] + ordered[:-1]))


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("seeded", [False, True])
def test_requests_sharing_a_prefix_copy_it_and_get_the_same_tokens(programs, pipelined, seeded):
    pte = programs[pipelined]
    meta = DecoderMeta.load(pte)
    eos = meta.eos_token_ids[0]
    prompts = [PREFIX + [3 + i, 40 + i, 90 + i] for i in range(REQUESTS)]

    def sampling(i):
        base = {"logit_bias": {eos: -100}}
        return {**base, "temperature": 1.0, "seed": 100 + i, "top_k": 30} if seeded else base

    method = load_method(pte)
    assert method.can_copy_rows
    copied, prefilled = _serve(method, meta, prompts, sampling)
    alone, _ = _serve(load_method(pte), meta, prompts, sampling, prompt_cache=False)
    shared_none, prefilled_without = _serve(_NoCopies(load_method(pte)), meta, prompts, sampling)
    assert copied == alone == shared_none
    unique = _unique(prompts)
    assert prefilled <= 1.1 * unique
    assert prefilled_without >= 2 * unique  # rows that share nothing: the prefix once per row at least


class _Echo:
    """A stand-in program: every row samples token 1; its copies fail."""

    can_copy_rows = True

    def __init__(self, meta):
        self.meta, self.copies = meta, 0

    def execute(self, inputs):
        return [torch.ones(self.meta.batch, dtype=torch.int64)]

    def copy_rows(self, src, dst, n):
        self.copies += 1
        raise RuntimeError("no state here")


def test_a_failed_copy_costs_the_reuse_not_the_request():
    meta = DecoderMeta.build(max_seq_len=256, vocab_size=50, batch=2, eos_token_ids=[0], seeded=True,
                             config=SamplerConfig(), dtype="float32", ring_cache=False)
    program = _Echo(meta)
    engine = Engine(program, meta)
    engine.running = True
    prefix = [2 + i % 40 for i in range(200)]
    first = EngineRequest(prefix + [41], SamplingParams(), 3, lambda event: None)
    second = EngineRequest(prefix + [42], SamplingParams(), 3, lambda event: None)
    engine.submit_all([first, second])
    while True:
        assert engine._drain()
        engine._admit()
        if not engine.active_rows and not engine.waiting:
            break
        engine._step()
    assert program.copies == 1  # the second waited for the first's prefill, then tried to copy it
    assert (first.cached_tokens, second.cached_tokens) == (0, 0)


def test_ring_programs_never_copy():
    meta = DecoderMeta.build(max_seq_len=64, vocab_size=50, batch=2, eos_token_ids=[0], seeded=True,
                             config=SamplerConfig(), dtype="float32", ring_cache=True)
    assert not Engine(_Echo(meta), meta).core.copies


def test_the_server_worker_copies_rows_too(programs):
    """`etmlx serve` runs the program in a worker process (serve/program_worker.py): copies go through it."""
    from backends.mlx.serve.supervisor import SupervisedProgram

    pte = programs[True]
    meta = DecoderMeta.load(pte)
    prompts = [PREFIX + [3 + i, 40 + i] for i in range(6)]

    def sampling(i):
        return {"logit_bias": {meta.eos_token_ids[0]: -100}, "temperature": 0.8, "seed": i}

    worker = SupervisedProgram.for_pte(pte)
    try:
        assert worker.can_copy_rows
        copied, prefilled = _serve(worker, meta, prompts, sampling)
    finally:
        worker.close()
    alone, _ = _serve(load_method(pte), meta, prompts, sampling, prompt_cache=False)
    assert copied == alone
    assert prefilled <= 1.1 * _unique(prompts)
