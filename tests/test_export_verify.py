"""export_decoder / `etmlx export` run the program they wrote and check it against the eager model
(llm/decoder/verify.py): a right program passes, a wrong one fails with one line naming the first
divergent step and is removed, near ties are reported, logprobs are compared."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import backends.mlx.llm.decoder.export as decoder_export
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.verify import (PROMPT_TOKENS, RELATIVE_TOLERANCE, VerificationError, tolerance,
                                             verification_prompt, verify_decoder)
from backends.mlx.llm.sampler.config import SamplerConfig
from helpers import run_cli

pytestmark = pytest.mark.slow  # whole decoders exported and verified, in-process CLI exports

VOCAB = 90


def _model(seed=5):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         eos_token_id=None, bos_token_id=None)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # sharp logits: a wrong program changes the greedy tokens
    return model


class _Reference(torch.nn.Module):
    """The eager model with the logits of decode step `from_step` on changed by `edit(logits [V]) -> [V]`
    (verify_decoder reads step k's logits at position PROMPT_TOKENS - 1 + k of one forward)."""

    def __init__(self, model, edit, from_step=0):
        super().__init__()
        self.model, self.edit, self.from_step = model, edit, from_step

    def forward(self, ids):
        logits = self.model(ids).logits.clone()
        for position in range(PROMPT_TOKENS - 1 + self.from_step, ids.shape[1]):
            logits[0, position] = self.edit(logits[0, position])
        return SimpleNamespace(logits=logits)


def _second_raised_by(fraction):
    """The runner-up lifted `fraction` x the tolerance above the top logit: eager's argmax becomes it."""

    def edit(logits):
        top2 = torch.topk(logits, 2).indices
        logits[top2[1]] = logits[top2[0]] + fraction * tolerance_at(logits)
        return logits

    return edit


def tolerance_at(logits):  # float32's, as verify_decoder computes it
    return RELATIVE_TOLERANCE[torch.float32] * max(1.0, float(logits.abs().max()))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A pipelined program with logprobs, batch 2 and penalties, and the progress lines of its export."""
    out = tmp_path_factory.mktemp("verify") / "m.pte"
    lines = []
    model = _model()
    export_decoder(model, out, 40, config=SamplerConfig(top_k=True, penalties=True, logprobs=3), batch=2,
                   progress=lines.append)
    return model, out, lines


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Unpipelined, unseeded, no logprobs: an edited reference's logprobs do not get in the way."""
    out = tmp_path_factory.mktemp("verify") / "plain.pte"
    model = _model()
    export_decoder(model, out, 40, seeded=False, pipelined=False)
    return model, out


def test_a_right_export_is_verified(exported):
    model, out, lines = exported
    assert out.is_file()
    verified = [line for line in lines if line.startswith("verified")]
    assert verified == ["verified against the eager model (float32): 5 greedy tokens match, logprobs within "
                        + verified[0].split("logprobs within ")[1]], lines
    report = verify_decoder(model, out)
    assert report.steps == 5 and not report.near_ties
    assert report.max_logprob_error is not None and report.max_logprob_error <= 2 * tolerance(model)


def test_weights_changed_after_export_fail_at_the_prefill(exported):
    model, out, _ = exported
    changed = _model(seed=7)  # same architecture, other weights (its first token differs)
    with pytest.raises(VerificationError) as failure:
        verify_decoder(changed, out)
    message = str(failure.value)
    assert "\n" not in message
    assert message.startswith(f"{out} decodes differently from the eager model at prefill: expected token ")
    assert "eager logit gap" in message and "(float32)" in message


def test_a_near_tie_is_reported_and_a_wider_gap_fails(plain):
    model, out = plain
    report = verify_decoder(_Reference(model, _second_raised_by(0.5)), out)
    assert report.steps == 5 and len(report.near_ties) == 5, report.summary()
    assert report.near_ties[0].startswith("prefill: expected token")
    with pytest.raises(VerificationError, match=r"at prefill: expected token \d+ \(eager greedy\), got \d+; eager "
                                                r"logit gap [-0-9.e]+ > tolerance"):
        verify_decoder(_Reference(model, _second_raised_by(2.0)), out)


def test_a_divergence_after_the_prefill_names_its_step(plain):
    model, out = plain
    with pytest.raises(VerificationError, match="at decode step 2: expected token"):
        verify_decoder(_Reference(model, _second_raised_by(3.0), from_step=2), out)


def test_logprobs_unlike_eager_fail(exported):
    model, out, _ = exported
    # Sharper logits keep every argmax but move every logprob.
    with pytest.raises(VerificationError, match="returns logprobs unlike the eager model at prefill: the chosen"):
        verify_decoder(_Reference(model, lambda logits: logits * 1.2), out)


def test_the_prompt_is_deterministic_and_spans_the_vocabulary():
    assert verification_prompt(VOCAB, 8) == verification_prompt(VOCAB, 8)
    assert len(set(verification_prompt(VOCAB, 8))) > 4
    assert all(0 <= t < VOCAB for t in verification_prompt(VOCAB, 8))


def _export_with_wrong_program(monkeypatch):
    """The exporter writes a program whose head differs from the eager model's (as an exporter bug would)."""
    real = decoder_export.export_to_pte

    def wrong_program(program, *args, **kwargs):
        head = next(p for name, p in program.named_parameters() if name.endswith("lm_head.weight"))
        saved = head.detach().clone()
        with torch.no_grad():
            head.copy_(torch.roll(saved, 1, dims=0))
        def restore():
            with torch.no_grad():
                head.copy_(saved)

        try:
            result = real(program, *args, **kwargs)
        except BaseException:
            restore()
            raise
        # The program reads its weights in place until it is saved (docs/weights.md): restore after saving.
        write = result.save

        def save_then_restore(path):
            try:
                return write(path)
            finally:
                restore()

        result.save = save_then_restore
        return result

    monkeypatch.setattr(decoder_export, "export_to_pte", wrong_program)


def test_cli_exits_nonzero_and_removes_a_wrong_program(tmp_path, monkeypatch):
    ckpt, pte = tmp_path / "ckpt", tmp_path / "bad.pte"
    _model().save_pretrained(ckpt)
    _export_with_wrong_program(monkeypatch)
    failed = run_cli("export", "--model", ckpt, "--out", pte, "--max-seq-len", "32")
    assert failed.returncode == 2
    error = failed.stderr.strip().splitlines()[-1]
    assert error.startswith(f"etmlx: error: {pte} decodes differently from the eager model at prefill: expected ")
    assert error.endswith(f"removed {pte} (verify=False / --no-verify keeps it)")
    assert not pte.exists()
    kept = run_cli("export", "--model", ckpt, "--out", pte, "--max-seq-len", "32", "--no-verify")
    assert kept.returncode == 0 and pte.is_file()
    assert "verif" not in kept.stderr


def test_cli_reports_the_verification(tmp_path):
    ckpt, pte = tmp_path / "ckpt", tmp_path / "ok.pte"
    _model().save_pretrained(ckpt)
    done = run_cli("export", "--model", ckpt, "--out", pte, "--max-seq-len", "32", "--no-pipeline", "--unseeded")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "verified against the eager model (float32): 5 greedy tokens match" in done.stderr
