"""Text first: one tokenization rule on every path (CLI, OpenAI, LMTP, Python API), the chat template by
default in `etmlx generate`, `etmlx chat` over stdin, `etmlx.load/generate/stream_generate`, `--version`
and `python -m etmlx`, the light tokenizer agreeing with transformers, and a generate path that stays
quiet and never loads the exporter (nor transformers, for a plain tokenizer.json tokenizer).

The tokenizer is the built-in model's kind: its post-processor puts BOS in front of raw text and its
chat template writes BOS itself, so a path that adds BOS twice, or not at all, shows."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
TEXT = "Mira went to the mill"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from backends.mlx.llm.builtin.tiny_model import tiny_llama
    from backends.mlx.llm.builtin.tokenizer import train_tokenizer
    from backends.mlx.llm.decoder.export import export_decoder
    from backends.mlx.llm.sampler.config import SamplerConfig

    docs = ["Mira went to the mill by the river.", "The miller gave Mira flour and plum cake.",
            "Where does Mira live? In the blue house."] * 8
    tokenizer = train_tokenizer(docs, vocab_size=300)
    model = tiny_llama(len(tokenizer), tokenizer.eos_token_id, hidden=32, seed=3)
    pte = tmp_path_factory.mktemp("text_api") / "m.pte"
    export_decoder(model, pte, 64, config=SamplerConfig(top_k=True, logprobs=2), tokenizer=tokenizer)
    return pte, model, tokenizer


def _json(*args):
    ran = run_cli("generate", *args, "--json")
    assert ran.returncode == 0, ran.stderr[-2000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


@torch.no_grad()
def _greedy(model, ids, steps):
    out = model.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_text_gets_bos_once_on_every_path(exported):
    from backends.mlx.cli.prompt_args import prompt_ids as cli_prompt
    from backends.mlx.llm.decoder.meta import DecoderMeta
    from backends.mlx.llm.decoder.prompt import encode_prompt
    from backends.mlx.serve.lmtp_session import prompt_ids as lmtp_prompt
    from backends.mlx.serve.openai_params import completion_prompt

    pte, _, tok = exported
    meta = DecoderMeta.load(pte)
    expected = tok(TEXT)["input_ids"]
    assert expected[0] == tok.bos_token_id and expected[1:] == tok.encode(TEXT, add_special_tokens=False)
    args = argparse.Namespace(prompt=TEXT, prompt_ids=None, ignore_chat_template=True, system_prompt=None)
    cli = cli_prompt(args, SimpleNamespace(tokenizer=tok))
    assert cli == completion_prompt({"prompt": TEXT}, tok, meta) == lmtp_prompt(TEXT, tok, meta.vocab_size) == expected
    # text that already starts with BOS gets no second one; token ids pass through untouched
    assert encode_prompt(tok, tok.bos_token + TEXT) == expected
    assert lmtp_prompt(expected[1:], tok, meta.vocab_size) == expected[1:]


def test_light_tokenizer_agrees_with_transformers(exported, tmp_path):
    from transformers import AutoTokenizer

    from backends.mlx.llm.builtin.tiny_model import train_tokenizer as tiny_tokenizer
    from backends.mlx.llm.decoder.light_tokenizer import LightTokenizer, load_light, load_tokenizer
    from backends.mlx.llm.decoder.tokenizer_files import extract_tokenizer

    tiny = tmp_path / "tiny"
    tiny_tokenizer().save_pretrained(tiny)  # no BOS, a template without bos_token
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Where?"}]
    for path in (extract_tokenizer(exported[0], tmp_path / "embedded"), tiny):
        hf, light = AutoTokenizer.from_pretrained(str(path)), load_tokenizer(path)
        assert isinstance(light, LightTokenizer) and light.bos_token == hf.bos_token and len(light) == len(hf)
        for text in (TEXT, "<|bos|>" + TEXT, "über café 日本 🙂", " a  b\n\nc", ""):
            for special in (True, False):
                ids = hf.encode(text, add_special_tokens=special)
                assert light.encode(text, add_special_tokens=special) == ids
                assert light.decode(ids, skip_special_tokens=special) == hf.decode(ids, skip_special_tokens=special)
        for generation in (True, False):
            assert (light.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
                    == hf.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False))
    # a class that may rewrite tokenizer.json's rules in Python goes to transformers
    config = tiny / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "add_bos_token": True}))
    assert load_light(tiny) is None and not isinstance(load_tokenizer(tiny), LightTokenizer)


def test_generate_applies_the_chat_template_unless_told_not_to(exported):
    pte, model, tok = exported
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    chat_ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    assert chat_ids.count(tok.bos_token_id) == 1
    templated = _json(str(pte), "-p", TEXT, "--system-prompt", "Be brief.", "-m", "6")
    assert templated["prompt_tokens"] == len(chat_ids) and templated["tokens"] == _greedy(model, chat_ids, 6)
    raw = _json(str(pte), "--prompt", TEXT, "--ignore-chat-template", "--max-tokens", "6")
    raw_ids = tok(TEXT)["input_ids"]
    assert raw["prompt_tokens"] == len(raw_ids) and raw["tokens"] == _greedy(model, raw_ids, 6)
    ran = run_cli("generate", str(pte), "-p", TEXT, "--ignore-chat-template", "--system-prompt", "x")
    assert ran.returncode == 2 and "--system-prompt needs the chat template" in ran.stderr


def test_temp_alias_and_model_flag(exported):
    pte, _, _ = exported
    a = _json("--model", str(pte), "-p", TEXT, "-m", "8", "--temp", "1.5", "--seed", "4")
    b = _json(str(pte), "-p", TEXT, "-m", "8", "--temperature", "1.5", "--seed", "4")
    greedy = _json(str(pte), "-p", TEXT, "-m", "8")
    assert a["tokens"] == b["tokens"] and a["tokens"] != greedy["tokens"]


def test_python_api_matches_the_cli(exported):
    import etmlx

    pte, _, tok = exported
    model = etmlx.load(pte)
    cli = _json(str(pte), "-p", TEXT, "--ignore-chat-template", "-m", "10")
    assert etmlx.generate(model, TEXT, max_tokens=10) == cli["text"]
    responses = list(etmlx.stream_generate(model, TEXT, max_tokens=10))
    assert [r.token for r in responses] == cli["tokens"] and "".join(r.text for r in responses) == cli["text"]
    assert responses[-1].finish_reason == cli["finish_reason"] and all(r.finish_reason is None for r in responses[:-1])
    last = responses[-1]
    assert last.logprobs[last.token] == pytest.approx(cli["logprobs"][-1]) and len(last.logprobs) <= 3
    # chat messages go through the template, as generate's default does
    chat = _json(str(pte), "-p", TEXT, "-m", "10")
    assert etmlx.generate(model, [{"role": "user", "content": TEXT}], max_tokens=10) == chat["text"]
    sampled = etmlx.generate(model, TEXT, max_tokens=10, temperature=1.0, seed=9, top_k=5)
    assert sampled == _json(str(pte), "-p", TEXT, "--ignore-chat-template", "-m", "10", "--temp", "1",
                            "--seed", "9", "--top-k", "5")["text"]
    with pytest.raises(TypeError, match="unknown sampling option"):
        etmlx.generate(model, TEXT, temprature=1.0)


def _run(*args, stdin=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, input=stdin, env=ENV,
                          cwd=REPO, timeout=300)


@pytest.mark.subprocess
def test_chat_two_turns_from_stdin(exported):
    pte, _, tok = exported
    ran = _run("-m", "etmlx", "chat", str(pte), "-m", "5", stdin="Hello\nWhere does Mira live?\n/reset\nHello\n")
    assert ran.returncode == 0, ran.stderr[-2000:]
    first = _json(str(pte), "-p", "Hello", "-m", "5")["text"]
    # the second turn sees the first: its prompt is the whole conversation
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "Where does Mira live?"}]
    text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    import etmlx

    second = etmlx.generate(etmlx.load(pte), text, max_tokens=5)
    assert ran.stdout == f"{first}\n{second}\n{first}\n"  # /reset: the same first turn again
    assert "[conversation cleared]" in ran.stderr


@pytest.mark.subprocess
def test_chat_resumes_a_conversation_kept_in_a_file(exported, tmp_path):
    pte, _, _ = exported
    store = tmp_path / "chat.safetensors"
    first = _run("-m", "etmlx", "chat", str(pte), "-m", "5", "--prompt-cache", str(store), stdin="Hello\n")
    assert first.returncode == 0, first.stderr[-2000:]
    assert store.is_file()
    resumed = _run("-m", "etmlx", "chat", str(pte), "-m", "5", "--prompt-cache", str(store),
                   stdin="Where does Mira live?\n")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "[resumed 2 messages from" in resumed.stderr
    cached = int(resumed.stderr.split("messages from")[1].split(": ")[1].split(" tokens")[0])
    assert cached > 10  # the first turn's prompt and reply came from the file, not a prefill
    both = _run("-m", "etmlx", "chat", str(pte), "-m", "5", stdin="Hello\nWhere does Mira live?\n")
    assert first.stdout + resumed.stdout == both.stdout  # the second turn as without a restart


def _with_turns(store: Path, turns: list[dict]) -> None:
    """The chat file `store` with other saved turns (and the checksum they need: an editor can compute it)."""
    from backends.mlx.llm.decoder import cache_file

    tensors, metadata = cache_file._read_safetensors(store)
    cache_file._write_safetensors(store, tensors, {**metadata, "user.etmlx.chat.turns": json.dumps(turns)})


@pytest.mark.subprocess
def test_chat_refuses_saved_turns_its_template_refuses(exported, tmp_path):
    """Roles the built-in template does not know (a tool message) were a jinja2 traceback at the next turn."""
    pte, _, _ = exported
    store = tmp_path / "chat.safetensors"
    assert _run("-m", "etmlx", "chat", str(pte), "-m", "3", "--prompt-cache", str(store),
                stdin="Hello\n").returncode == 0
    _with_turns(store, [{"role": "system", "content": "Be brief."}, {"role": "tool", "content": "42"}])
    ran = _run("-m", "etmlx", "chat", str(pte), "-m", "3", "--prompt-cache", str(store), stdin="Hello\n")
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr[-2000:]
    assert "holds messages the chat template refuses" in ran.stderr and len(ran.stderr.strip().splitlines()) == 1
    _with_turns(store, [{"role": "user", "content": 7}])
    ran = _run("-m", "etmlx", "chat", str(pte), "-m", "3", "--prompt-cache", str(store), stdin="Hello\n")
    assert ran.returncode == 2 and "holds no etmlx chat" in ran.stderr, ran.stderr[-2000:]


@pytest.mark.subprocess
def test_chat_resumed_with_a_turn_too_long_to_keep_drops_it(exported, tmp_path):
    """A saved message that alone fills the cache: the next turn drops it, not the new message too (which
    was "messages must be a non-empty list")."""
    pte, _, _ = exported
    store = tmp_path / "chat.safetensors"
    assert _run("-m", "etmlx", "chat", str(pte), "-m", "3", "--prompt-cache", str(store),
                stdin="Hello\n").returncode == 0
    _with_turns(store, [{"role": "user", "content": "Mira went to the mill. " * 200}])
    ran = _run("-m", "etmlx", "chat", str(pte), "-m", "3", "--prompt-cache", str(store), stdin="Hello\n")
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "dropped the oldest exchange" in ran.stderr and ran.stdout.strip()


@pytest.mark.subprocess
def test_chat_drops_the_oldest_exchange_when_full(exported):
    pte, _, _ = exported
    lines = "".join(f"Where does Mira live? Tell me about the mill {i}\n" for i in range(6))
    ran = _run("-m", "etmlx", "chat", str(pte), "-m", "8", stdin=lines)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "the conversation is full (max_seq_len 64): dropped the oldest exchange" in ran.stderr


def test_version_and_python_m_etmlx():
    from importlib.metadata import version

    ran = _run("-m", "etmlx", "--version")
    # the version, then which malloc the command runs with (runtime/allocator.py; tests/test_allocator.py)
    assert ran.returncode == 0 and ran.stdout.strip().startswith(f"etmlx {version('etmlx')} (malloc: "), ran.stdout
    light = _run("-c", "import sys, etmlx; print(etmlx.__version__, 'torch' in sys.modules)")
    assert light.stdout.split() == [version("etmlx"), "False"], light.stderr


@pytest.mark.subprocess
def test_generate_path_is_quiet_and_never_loads_the_exporter(exported):
    pte, _, _ = exported
    # transformers too: this tokenizer is a plain tokenizer.json one, which loads without it
    heavy = ("backends.mlx.exporter", "executorch.exir", "torchao", "executorch.runtime", "transformers")
    code = ("import sys\nfrom backends.mlx.cli.main import main\n"
            f"code = main(['generate', {str(pte)!r}, '-p', 'Mira', '-m', '3'])\n"
            f"print(sorted(m for m in sys.modules if m.startswith({heavy!r})), code)")
    ran = _run("-c", code)
    assert ran.stdout.strip().splitlines()[-1] == "[] 0", ran.stdout
    # stderr holds only our own summary line: no torchao, pytree or transformers output
    assert [line for line in ran.stderr.splitlines() if not line.startswith("[")] == [], ran.stderr
