"""etmlx_decode --mask-file: per-step allowed-token masks give the Python Decoder's tokens with the same masks.

The Python side feeds the same rows through Decoder's mask input (a stand-in matcher that replays them),
so greedy and seeded sampled tokens must agree one for one, and every token must be allowed by its row.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.meta import META_KEY, DecoderMeta
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from helpers import rewrite_named_data

pytestmark = pytest.mark.subprocess  # build/etmlx_decode runs

BINARY = Path(__file__).resolve().parents[1] / "build" / "etmlx_decode"
VOCAB, WORDS = 80, 3
PROMPT = [7, 1, 33, 20]
STEPS = 10


def _run(*args):
    assert BINARY.is_file(), f"{BINARY} is missing: `make setup` builds it"
    return subprocess.run([str(BINARY), *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def ptes(tmp_path_factory):
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         eos_token_id=None, bos_token_id=None)).eval()
    out = tmp_path_factory.mktemp("cpp_mask")
    masked, plain = out / "masked.pte", out / "plain.pte"
    export_decoder(model, masked, 48, config=SamplerConfig(top_k=True, allowed_mask=True))
    export_decoder(model, plain, 48)
    assert not DecoderMeta.load(masked).pipelined  # the default with the mask input
    return masked, plain


def test_structured_output_on_a_pipelined_program_is_one_line(tmp_path):
    """A pipelined program samples step k + 1 before the host knows token k: no per-step mask can follow the output.
    --mask-file and --choice-ids refuse it in one line that names the fix."""
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         eos_token_id=None, bos_token_id=None)).eval()
    piped = tmp_path / "piped_masked.pte"
    export_decoder(model, piped, 16, config=SamplerConfig(allowed_mask=True), pipelined=True)
    assert DecoderMeta.load(piped).pipelined
    args = ("--prompt-ids", "1,2", "--max-tokens", 3)
    for flag, value in (("--mask-file", _write(tmp_path / "m.txt", _rows(1))), ("--choice-ids", "3,4;5")):
        done = _run(piped, *args, flag, value)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and done.stdout == "", done.stderr
        assert lines[0].startswith(f"etmlx_decode: error: {flag}: ") and "piped_masked.pte is pipelined" in lines[0]
        assert "--sampler ...,mask" in lines[0] and "--no-pipeline" in lines[0]
    free = _run(piped, *args)  # without structured output it decodes
    assert free.returncode == 0 and len(free.stdout.split()) == 3, free.stderr


def _rows(seed: int) -> np.ndarray:
    """STEPS rows, each allowing a random ~20% of the tokens (at least one)."""
    gen = np.random.default_rng(seed)
    allowed = gen.random((STEPS, VOCAB)) < 0.2
    allowed[np.arange(STEPS), gen.integers(0, VOCAB, STEPS)] = True
    bits = np.zeros((STEPS, WORDS * 32), np.uint8)
    bits[:, :VOCAB] = allowed
    return np.packbits(bits.reshape(STEPS, WORDS, 32)[:, :, ::-1], axis=-1, bitorder="big").view(">u4").reshape(
        STEPS, WORDS).astype(np.uint32).view(np.int32)


def _allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


class _Replay:
    """Matcher stand-in: step k's mask is row k."""

    def __init__(self, rows):
        self.rows, self.k = rows, 0

    def mask(self, out):  # Matcher.mask's interface: fill `out`
        out[:] = self.rows[self.k] if self.k < len(self.rows) else np.full(WORDS, -1, np.int32)
        self.k += 1

    def advance(self, token):
        pass


def _python(decoder: Decoder, rows, params: SamplingParams) -> list[int]:
    replay = _Replay(rows)
    step = decoder.step_at(PROMPT, 0, params, 0, replay)
    out = [step.token]
    for k in range(1, STEPS):
        step = decoder.step_at([step.token], len(PROMPT) + k - 1, params, k, replay)
        out.append(step.token)
    return out


def _write(path: Path, rows, hex_words: bool = False) -> Path:
    fmt = (lambda w: f"0x{int(w) & 0xffffffff:08x}") if hex_words else str
    path.write_text("# one row per step\n" + "\n".join(" ".join(fmt(w) for w in r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("temperature,hex_words", [(0.0, False), (1.0, True), (0.7, False)])
def test_mask_file_matches_python_decoder(ptes, tmp_path, temperature, hex_words):
    masked, _ = ptes
    rows = _rows(int(temperature * 10))
    mask_file = _write(tmp_path / "masks.txt", rows, hex_words)
    done = _run(masked, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", STEPS, "--temperature",
                temperature, "--seed", 5, "--mask-file", mask_file)
    assert done.returncode == 0, done.stderr
    cpp = [int(t) for t in done.stdout.split()]
    assert cpp == _python(Decoder(masked), rows, SamplingParams(temperature=temperature, seed=5))
    assert all(_allowed(rows[k], t) for k, t in enumerate(cpp))
    free = _run(masked, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", STEPS, "--temperature",
                temperature, "--seed", 5)
    assert [int(t) for t in free.stdout.split()] != cpp  # control: the masks changed the output


def test_mask_file_errors(ptes, tmp_path):
    masked, plain = ptes
    rows = _rows(1)
    args = ("--prompt-ids", "1,2", "--max-tokens", 3)
    no_input = _run(plain, *args, "--mask-file", _write(tmp_path / "a.txt", rows))
    assert no_input.returncode == 2 and "exported with --sampler ...,mask" in no_input.stderr
    (tmp_path / "short.txt").write_text("-1 -1\n")
    short = _run(masked, *args, "--mask-file", tmp_path / "short.txt")
    assert short.returncode == 2 and "line 1 has 2 words" in short.stderr
    (tmp_path / "bad.txt").write_text("-1 -1 -1\n-1 zz -1\n")
    bad = _run(masked, *args, "--mask-file", tmp_path / "bad.txt")
    assert bad.returncode == 2 and "line 2" in bad.stderr and "not a 32-bit word" in bad.stderr
    (tmp_path / "empty_row.txt").write_text("-1 -1 -1\n0 0 0\n")
    empty = _run(masked, *args, "--mask-file", tmp_path / "empty_row.txt")
    assert empty.returncode == 2 and "step 1: the mask allows no token" in empty.stderr
    missing = _run(masked, *args, "--mask-file", tmp_path / "nope.txt")
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    for done in (no_input, short, bad, empty, missing):
        assert len(done.stderr.strip().splitlines()) <= 2 and "Traceback" not in done.stderr


def test_vocab_size_beyond_the_programs_mask_is_an_error(ptes, tmp_path):
    """Metadata whose vocabulary the program's mask input cannot hold is refused."""
    masked, _ = ptes
    meta = dataclasses.replace(DecoderMeta.load(masked), vocab_size=100000)
    copy = rewrite_named_data(masked, tmp_path / "copy.pte", {META_KEY: meta.to_bytes()})
    done = _run(copy, "--prompt-ids", "1", "--max-tokens", 2)
    assert done.returncode == 2 and "says vocab_size 100000 but the program's allowed_mask input has 3 words" in done.stderr
    ok = _run(masked, "--prompt-ids", "1", "--max-tokens", 2)
    assert ok.returncode == 0, ok.stderr


CHOICES = [[3, 4, 5], [3, 9], [60]]


class _Choices:
    """Python mirror of --choice-ids for a model without stop ids: next ids of the choices the output
    is a prefix of."""

    def __init__(self):
        self.out = []

    def mask(self, out):  # Matcher.mask's interface: fill `out`
        row = np.zeros(WORDS, np.uint32)
        for c in CHOICES:
            if c[:len(self.out)] == self.out and len(c) > len(self.out):
                row[c[len(self.out)] // 32] |= np.uint32(1 << (c[len(self.out)] % 32))
        out[:] = row.view(np.int32)

    def advance(self, token):
        self.out.append(token)


def test_choice_ids_give_one_choice_and_the_python_decoders_tokens(ptes):
    masked, _ = ptes
    decoder = Decoder(masked)
    seen = set()
    for seed in range(6):
        done = _run(masked, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", 8, "--temperature", 1.0,
                    "--seed", seed, "--choice-ids", ";".join(",".join(map(str, c)) for c in CHOICES))
        assert done.returncode == 0, done.stderr
        cpp = [int(t) for t in done.stdout.split()]
        assert cpp in CHOICES, cpp
        mirror = _Choices()
        params = SamplingParams(temperature=1.0, seed=seed)
        step = decoder.step_at(PROMPT, 0, params, 0, mirror)
        python = [step.token]
        while python not in CHOICES:
            step = decoder.step_at([step.token], len(PROMPT) + len(python) - 1, params, len(python), mirror)
            python.append(step.token)
        assert python == cpp
        seen.add(tuple(cpp))
    assert len(seen) > 1  # sampled, not one forced answer


def test_choice_ids_errors(ptes):
    masked, plain = ptes
    args = ("--prompt-ids", "1,2", "--max-tokens", 3)
    for pte, value, needle in ((plain, "1,2", "exported with --sampler ...,mask"),
                               (masked, "1,2;1,2", "given twice"), (masked, "1,500", "outside [0, 80)"),
                               (masked, "1,x", "--choice-ids")):
        done = _run(pte, *args, "--choice-ids", value)
        assert done.returncode == 2 and needle in done.stderr and len(done.stderr.strip().splitlines()) <= 2, done.stderr
