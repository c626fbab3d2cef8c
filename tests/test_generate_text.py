"""`etmlx generate --prompt TEXT` with the tokenizer exported beside the .pte: text, stop strings, logprobs,
penalties chosen at export, and clear errors for knobs the program lacks and for a missing tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from helpers import run_cli

PROMPT = "the cat sat on the mat"


_etmlx = run_cli


def _last_json(ran):
    assert ran.returncode == 0, ran.stderr[-2000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("textgen")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([PROMPT, "a dog ran in the park", "über café"] * 10,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128, eos_token_id=None, bos_token_id=None)).eval()
    ckpt = root / "ckpt"
    model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    pte = root / "m.pte"
    ran = _etmlx("export", "--model", str(ckpt), "--out", str(pte), "--max-seq-len", "64",
                 "--sampler", "top-k,penalties", "--logprobs", "3")
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "0 ops outside" in ran.stdout and "lowering to the etmlx delegate" in ran.stderr  # progress display
    return pte, model, tokenizer


def test_text_prompt_greedy_text_and_logprobs(exported):
    pte, model, tokenizer = exported
    out = _last_json(_etmlx("generate", str(pte), "--prompt", PROMPT, "--max-tokens", "12", "--json"))
    prompt = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        first = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
    assert out["tokens"] == expected and out["prompt_tokens"] == len(prompt)
    assert out["text"] == tokenizer.decode(expected)
    assert len(out["logprobs"]) == 12 and all(len(t) == 3 for t in out["top_logprobs"])
    assert abs(out["logprobs"][0] - float(first[expected[0]])) < 1e-4
    # greedy: the chosen token is the best alternative
    assert all(top[0]["id"] == tok and abs(top[0]["logprob"] - lp) < 1e-6
               for tok, lp, top in zip(out["tokens"], out["logprobs"], out["top_logprobs"]))
    assert out["time_to_first_token_s"] > 0 and out["decode_tokens_per_s"] > 0


def test_stop_string_ends_the_text_before_it(exported):
    pte, _, _ = exported
    full = _last_json(_etmlx("generate", str(pte), "--prompt", PROMPT, "--max-tokens", "12", "--json"))["text"]
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip(), f"greedy text {full!r} too short for this test"
    out = _last_json(_etmlx("generate", str(pte), "--prompt", PROMPT, "--max-tokens", "12", "--stop", stop, "--json"))
    assert out["text"] == full[:full.find(stop)] and out["finish_reason"] == "stop"


def test_presence_penalty_exported_and_used(exported):
    pte, _, _ = exported
    plain = _last_json(_etmlx("generate", str(pte), "--prompt", PROMPT, "--max-tokens", "20", "--json"))["tokens"]
    assert len(set(plain)) < len(plain), "the greedy control must repeat a token for this test to mean anything"
    out = _last_json(_etmlx("generate", str(pte), "--prompt", PROMPT, "--max-tokens", "20", "--presence-penalty", "2",
                            "--json"))
    assert len(set(out["tokens"])) == len(out["tokens"])  # a logit spread < 2: every seen token is pushed out


def test_knob_not_exported_and_missing_tokenizer_are_clear_errors(exported, tmp_path):
    pte, _, _ = exported
    ran = _etmlx("generate", str(pte), "--prompt", PROMPT, "--top-p", "0.5")
    assert ran.returncode == 2 and "top_p: this program was exported without it" in ran.stderr
    ran = _etmlx("generate", str(pte), "--prompt", PROMPT, "--top-k", "-1")
    assert ran.returncode == 2 and "top_k must be an integer >= 0" in ran.stderr
    # The .pte alone is the model: a renamed copy, with nothing beside it, tokenizes and decodes the same.
    copy = tmp_path / "copy.pte"
    shutil.copy(pte, copy)
    assert [p.name for p in tmp_path.iterdir()] == ["copy.pte"]
    same = [_last_json(_etmlx("generate", str(p), "--prompt", PROMPT, "--max-tokens", "4", "--json"))
            for p in (pte, copy)]
    assert same[0]["tokens"] == same[1]["tokens"] and same[0]["text"] == same[1]["text"]
