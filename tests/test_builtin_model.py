"""The built-in demo model: built offline from the shipped corpus, loadable by transformers, trained
enough to write corpus-like text, and cached (rebuilt only when missing, damaged or stale).

The suite trains one model per session with fewer steps than the shipped recipe (TEST_RECIPE) so it
stays fast; the cache tests use a tiny recipe that trains for a handful of steps.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from backends.mlx.llm.builtin import model as builtin_model
from backends.mlx.llm.builtin.corpus import CORPUS_PATH, EOS_TEXT, ROLE_TEXT, generate_corpus, load_documents
from backends.mlx.llm.builtin.model import (DEFAULT_RECIPE, STAMP, BuiltinRecipe, build_checkpoint,
                                            ensure_builtin_checkpoint, read_stamp)
from backends.mlx.llm.builtin.training import TrainingPlan, train
from run_once import shared_dir

pytestmark = pytest.mark.slow  # trains the built-in model

TEST_RECIPE = dataclasses.replace(DEFAULT_RECIPE, steps=60)
TINY_RECIPE = BuiltinRecipe(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32,
                            steps=3, batch=2, seq_len=32, warmup=1)
STORY_PROMPTS = ("One morning, Mira went to", "Early on Sunday, Leo went to the", "Last summer, Kofi",
                 "Yuki gave Tomas", "In the evening, Zoë went to the harbour. She wanted to")
# What "corpus-like" means: at least this share of adjacent word pairs in the output occur in the corpus.
CORPUS_LIKE = 0.8
NOT_CORPUS_LIKE = 0.3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # This model's matrices are tiny: a second thread costs more synchronisation than it saves.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    # Shared with test_quantized_perplexity.py (the same recipe): trained once per run, even across xdist
    # workers (ensure_builtin_checkpoint locks the cache directory while one of them trains).
    return ensure_builtin_checkpoint(shared_dir(tmp_path_factory, "builtin-steps60"), TEST_RECIPE)


@pytest.fixture(scope="session")
def loaded(trained):
    return AutoModelForCausalLM.from_pretrained(trained).eval(), AutoTokenizer.from_pretrained(trained)


@pytest.fixture(scope="session")
def untrained(loaded):
    """The control: the same architecture with its initial (seeded, untrained) weights."""
    model, _ = loaded
    torch.manual_seed(TEST_RECIPE.seed)
    return LlamaForCausalLM(model.config).eval()


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text)


def _corpus_bigrams() -> set[tuple[str, str]]:
    words = _words(CORPUS_PATH.read_text(encoding="utf-8"))
    return set(zip(words, words[1:]))


def _greedy_continuations(model, tokenizer, max_new_tokens=40) -> list[tuple[str, str]]:
    """(prompt, prompt + greedy continuation) for each story prompt."""
    texts = []
    for prompt in STORY_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)
        texts.append((prompt, tokenizer.decode(out[0], skip_special_tokens=True)))
    return texts


def _share_in_corpus(texts: list[tuple[str, str]]) -> tuple[float, int]:
    """The share of the generated word pairs that occur in the corpus, and how many pairs there were.

    Pairs rather than single words: the vocabulary holds most corpus words whole, so even random tokens
    are mostly corpus words; random pairs are not. The first pair counted joins the prompt's last word
    to the first generated word; pairs inside the prompt are not counted.
    """
    known = _corpus_bigrams()
    pairs = []
    for prompt, text in texts:
        words = _words(text)
        pairs += list(zip(words, words[1:]))[max(0, len(_words(prompt)) - 1):]
    return sum(pair in known for pair in pairs) / max(1, len(pairs)), len(pairs)


def test_shipped_corpus_is_the_generator_output_and_has_multibyte_text():
    text = CORPUS_PATH.read_text(encoding="utf-8")
    assert text == generate_corpus(), "run `python -m backends.mlx.llm.builtin.corpus`"
    assert 50_000 <= len(text.encode()) <= 300_000
    widths = {len(ch.encode()) for ch in text}
    assert {2, 3, 4} <= widths  # accented letters, Japanese and curly quotes, emoji


def test_checkpoint_loads_from_its_directory_alone(trained, loaded):
    model, tokenizer = loaded
    config = model.config
    assert config.model_type == "llama"
    assert config.max_position_embeddings >= 512
    assert config.vocab_size == len(tokenizer)
    assert model.dtype == torch.float32
    assert config.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert config.bos_token_id == tokenizer.bos_token_id
    assert tokenizer("Mira")["input_ids"][0] == tokenizer.bos_token_id
    saved = json.loads((trained / "tokenizer_config.json").read_text())
    assert "chat_template" in saved  # readable by loaders that do not know chat_template.jinja
    assert sorted(p.name for p in trained.iterdir()) == sorted([*read_stamp(trained)["files"], STAMP])


def test_tokenizer_round_trips_multibyte_text(loaded):
    _, tokenizer = loaded
    docs = [doc for doc in load_documents() if not doc.isascii()]
    assert len(docs) > 50
    for doc in docs:
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == doc
    unseen = "naïve façade — 你好, Grüße! 👩‍👩‍👧 𝄞 \t end"
    ids = tokenizer(unseen, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == unseen


def test_role_markers_and_eos_are_single_tokens(loaded):
    _, tokenizer = loaded
    for marker in (*ROLE_TEXT.values(), EOS_TEXT):
        assert len(tokenizer(marker, add_special_tokens=False)["input_ids"]) == 1


def test_chat_template_renders_chats_as_the_corpus_writes_them(loaded):
    _, tokenizer = loaded
    chats = [doc for doc in load_documents() if doc.startswith("<|")]
    assert any(doc.startswith(ROLE_TEXT["system"]) for doc in chats[:40])
    for doc in chats[:40]:
        turns = re.findall(r"<\|(system|user|assistant)\|>\n(.*?)<\|eos\|>", doc, flags=re.S)
        messages = [{"role": role, "content": content} for role, content in turns]
        assert tokenizer.apply_chat_template(messages, tokenize=False) == tokenizer.bos_token + doc
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|bos|><|user|>\nHi<|eos|>\n<|assistant|>\n"
    with pytest.raises(Exception, match="roles system, user and assistant"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_training_lowers_the_corpus_loss_fivefold(trained, loaded, untrained):
    model, tokenizer = loaded
    docs = load_documents()[::25]
    ids = torch.tensor(tokenizer("\n\n".join(docs))["input_ids"][:1 + 4 * 128]).view(1, -1)
    windows = torch.cat([ids[:, i * 128:(i + 1) * 128 + 1] for i in range(4)])

    def corpus_loss(m):
        with torch.no_grad():
            logits = m(input_ids=windows[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()

    before, after = corpus_loss(untrained), corpus_loss(model)
    assert after * 5 <= before, (before, after)
    stamp = read_stamp(trained)
    assert stamp["final_loss"] * 5 <= stamp["first_loss"], stamp["loss_log"]


def test_greedy_text_is_corpus_like_and_the_untrained_control_is_not(loaded, untrained):
    model, tokenizer = loaded
    share, pairs = _share_in_corpus(_greedy_continuations(model, tokenizer))
    assert pairs >= 60 and share >= CORPUS_LIKE, (share, pairs)
    control, _ = _share_in_corpus(_greedy_continuations(untrained, tokenizer))
    assert control < NOT_CORPUS_LIKE, control


def test_a_chat_reply_ends_with_eos(loaded):
    model, tokenizer = loaded
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Where does Mira live?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
    reply = out[0, ids.shape[1]:].tolist()
    assert reply[-1] == tokenizer.eos_token_id, tokenizer.decode(reply)
    share, _ = _share_in_corpus([("", tokenizer.decode(reply, skip_special_tokens=True))])
    assert share >= CORPUS_LIKE


def test_second_call_reuses_the_cache_without_training(trained, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in trained.iterdir()}
    monkeypatch.setattr(builtin_model, "train", _must_not_train)
    assert ensure_builtin_checkpoint(trained.parent, TEST_RECIPE) == trained
    assert {p.name: p.stat().st_mtime_ns for p in trained.iterdir()} == before


def _must_not_train(*args, **kwargs):
    raise AssertionError("the cached checkpoint was rebuilt")


@pytest.fixture
def counting_train(monkeypatch):
    """Counts the training runs (each build trains once) while still training."""
    calls = []
    real = builtin_model.train

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(builtin_model, "train", counted)
    return calls


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", [
    lambda ckpt: _truncate(ckpt / "model.safetensors"),
    lambda ckpt: (ckpt / "tokenizer.json").unlink(),
    lambda ckpt: (ckpt / STAMP).unlink(),  # a build interrupted before its stamp
    lambda ckpt: (ckpt / STAMP).write_text("{not json"),
    lambda ckpt: (ckpt / "config.json").write_text("{}"),
], ids=["truncated-weights", "missing-tokenizer", "no-stamp", "bad-stamp", "edited-config"])
def test_a_damaged_cache_is_rebuilt(tmp_path, counting_train, damage):
    ckpt = ensure_builtin_checkpoint(tmp_path, TINY_RECIPE)
    damage(ckpt)
    assert ensure_builtin_checkpoint(tmp_path, TINY_RECIPE) == ckpt
    assert len(counting_train) == 2
    AutoModelForCausalLM.from_pretrained(ckpt)
    assert ensure_builtin_checkpoint(tmp_path, TINY_RECIPE) == ckpt
    assert len(counting_train) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".builtin-llama.lock", "builtin-llama"]


def test_leftovers_of_a_killed_build_are_removed(tmp_path, counting_train):
    (tmp_path / ".builtin-llama.build-x1y2").mkdir()
    (tmp_path / ".builtin-llama.build-x1y2" / "model.safetensors").write_bytes(b"half")
    ensure_builtin_checkpoint(tmp_path, TINY_RECIPE)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".builtin-llama.lock", "builtin-llama"]


def test_a_changed_recipe_or_corpus_is_rebuilt(tmp_path, counting_train):
    ckpt = ensure_builtin_checkpoint(tmp_path, TINY_RECIPE)
    other = dataclasses.replace(TINY_RECIPE, seed=1)
    ensure_builtin_checkpoint(tmp_path, other)
    assert len(counting_train) == 2 and read_stamp(ckpt)["recipe"]["seed"] == 1
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS_PATH.read_text(encoding="utf-8") + "\nOne more story about Mira.\n", encoding="utf-8")
    ensure_builtin_checkpoint(tmp_path, other, corpus_path=corpus)
    assert len(counting_train) == 3


def test_builds_are_deterministic_and_leave_the_callers_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = build_checkpoint(tmp_path / "a", TINY_RECIPE)
    assert torch.equal(torch.rand(3), expected_next)
    second = build_checkpoint(tmp_path / "b", TINY_RECIPE)
    assert first["files"] == second["files"]


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="cache_dir"):
        ensure_builtin_checkpoint(42)
    with pytest.raises(TypeError, match="recipe"):
        ensure_builtin_checkpoint("x", recipe={"steps": 1})
    with pytest.raises(ValueError, match="hidden_size"):
        BuiltinRecipe(hidden_size=0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        BuiltinRecipe(num_kv_heads=3)
    with pytest.raises(ValueError, match="seq_len"):
        BuiltinRecipe(seq_len=1024)
    with pytest.raises(ValueError, match="lr"):
        BuiltinRecipe(lr=0.0)


def test_missing_corpus_and_non_empty_out_dir_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus_path"):
        ensure_builtin_checkpoint(tmp_path, TINY_RECIPE, corpus_path=tmp_path / "nope.txt")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    with pytest.raises(ValueError, match="out_dir"):
        build_checkpoint(tmp_path / "out", TINY_RECIPE)


def test_learning_rate_warms_up_then_decays_to_its_floor():
    plan = TrainingPlan(steps=100, batch=1, seq_len=8, lr=0.01, warmup=10, seed=0)
    rates = [plan.lr_at(step) for step in range(100)]
    assert rates[0] == pytest.approx(0.001) and rates[9] == pytest.approx(0.01)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))
    assert rates[-1] == pytest.approx(0.001, rel=0.01)


def test_bad_training_plans_are_named():
    with pytest.raises(ValueError, match="steps"):
        TrainingPlan(steps=0, batch=1, seq_len=8, lr=0.01, warmup=0, seed=0)
    with pytest.raises(ValueError, match="lr"):
        TrainingPlan(steps=1, batch=1, seq_len=8, lr=-1.0, warmup=0, seed=0)
    plan = TrainingPlan(steps=1, batch=1, seq_len=8, lr=0.01, warmup=0, seed=0)
    with pytest.raises(ValueError, match="shorter than one window"):
        train(torch.nn.Linear(1, 1), torch.arange(5), plan)
