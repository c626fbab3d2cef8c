"""The export check of a --kv-bits program compares it with the eager model over the program's own cache entries
(kv_reference.py `pin_program_cache`): at 8B a key rounded to the neighbouring 4-bit step by an ulp's difference
upstream moved a logit by 0.4, so the check refused correct programs. Here, on a tiny program: the pinned reference
reads the program's buffers layer by layer (its logits equal the unpinned reference's where the entries are the
same), follows them (one entry moved by a step changes its logits and stays within the bound), and the bound on the
entries fails a program whose cache holds wrongly packed values (control)."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from backends.mlx.llm.decoder import verify as V
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.kv_reference import KvCacheReference
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.sampler.params import SamplingParams

GROUP = 32


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                           initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                           pad_token_id=0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    pte = tmp_path_factory.mktemp("pinned") / "kv4.pte"
    export_decoder(model, pte, 64, kv_bits=4, kv_group_size=GROUP, verify=False)
    return model, pte


class _Edited:
    """A ProgramState whose read() returns the program's entries after `edit` (a function of the list)."""

    def __init__(self, state, edit):
        self.buffers, self._state, self._edit = state.buffers, state, edit

    def read(self, row, n):
        return self._edit([t.clone() for t in self._state.read(row, n)])


def _ids_and_state(pte, prompt_len=8, steps=5):
    decoder = Decoder(pte)
    prompt = V.verification_prompt(decoder.meta.vocab_size, prompt_len)
    tokens = [s.token for s in decoder.stream(prompt, steps, SamplingParams(), stop_at_eos=False)]
    return decoder, prompt + tokens[:-1]


def test_the_pinned_reference_reads_each_layers_entries(program):
    model, pte = program
    decoder, ids = _ids_and_state(pte)
    plain = KvCacheReference(model, 4, GROUP)(torch.tensor([ids])).logits[0]
    pinned_ref = KvCacheReference(model, 4, GROUP)
    assert pinned_ref.pin_program_cache(decoder.method.state, len(ids))
    assert len(pinned_ref.pinned) == model.config.num_hidden_layers
    pinned = pinned_ref(torch.tensor([ids])).logits[0]
    assert pinned_ref.pin_steps <= V.PINNED_CACHE_STEPS
    torch.testing.assert_close(pinned, plain, atol=1e-4, rtol=1e-4)  # float32, unquantized weights: the same cache

    def one_step(entries):  # layer 1's first key value at position 3 moved to the neighbouring integer
        packed = entries[6]
        packed[0, 3, 0] = packed[0, 3, 0] ^ 1
        return entries

    moved = KvCacheReference(model, 4, GROUP)
    assert moved.pin_program_cache(_Edited(decoder.method.state, one_step), len(ids))
    moved_logits = moved(torch.tensor([ids])).logits[0]
    assert moved.pin_steps <= V.PINNED_CACHE_STEPS
    assert not torch.equal(moved_logits[3:], pinned[3:])  # the positions after it see the moved key
    torch.testing.assert_close(moved_logits[:3], pinned[:3])  # the ones before do not


def test_the_check_passes_the_program_and_refuses_wrongly_packed_entries(program, monkeypatch):
    model, pte = program
    reference = KvCacheReference(model, 4, GROUP)
    pinned = []
    real_pin = KvCacheReference.pin_program_cache
    monkeypatch.setattr(KvCacheReference, "pin_program_cache",
                        lambda self, state, n: pinned.append(real_pin(self, state, n)) or pinned[-1])
    report = V.verify_decoder(reference, pte)
    assert pinned == [True] and report.steps == V.DECODE_STEPS + 1
    assert reference.pinned is None  # unpinned once checked: later checks run other sequences

    real_read = type(Decoder(pte).method.state).read

    def swapped_nibbles(self, row, n):  # the control: every packed byte's two values exchanged
        entries = real_read(self, row, n)
        for k in range(0, len(entries), 3):
            entries[k] = ((entries[k] >> 4) | (entries[k] << 4)).to(torch.uint8)
        return entries

    monkeypatch.setattr(type(Decoder(pte).method.state), "read", swapped_nibbles)
    with pytest.raises(V.VerificationError, match="quantization steps farther from the eager keys"):
        V.verify_decoder(KvCacheReference(model, 4, GROUP), pte)
