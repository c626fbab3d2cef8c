"""Checkpoints by Hugging Face repo id (llm/checkpoint_source.py), offline: a cache directory in
huggingface_hub's own layout holds tiny random checkpoints, and HF_HUB_OFFLINE=1 keeps the network out.

The resolution runs in child processes: huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when it is
imported, so the environment is what decides, as it is for a user."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.mlx.llm.checkpoint_source import CheckpointSourceError, default_pte_name, resolve_checkpoint
from helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
REPO_ID = "etmlx-test/tiny-llama"
MAIN = "a" * 40  # commit hashes of the two cached revisions
OLDER = "b" * 40


def _tiny(seed: int):
    from backends.mlx.llm.builtin.tiny_model import tiny_llama, train_tokenizer

    tokenizer = train_tokenizer()
    return tiny_llama(len(tokenizer), tokenizer.eos_token_id, hidden=32, layers=1, seed=seed), tokenizer


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """models--etmlx-test--tiny-llama with snapshots MAIN (refs/main) and OLDER (refs/v0, a tag): different
    weights, so a test can tell which one was used."""
    cache = tmp_path_factory.mktemp("hf_cache")
    storage = cache / ("models--" + REPO_ID.replace("/", "--"))
    for commit, seed in ((MAIN, 1), (OLDER, 2)):
        model, tokenizer = _tiny(seed)
        model.save_pretrained(storage / "snapshots" / commit)
        tokenizer.save_pretrained(storage / "snapshots" / commit)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(MAIN)
    (storage / "refs" / "v0").write_text(OLDER)
    return cache


def _env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _resolve(cache: Path, model: str, revision: str | None = None) -> subprocess.CompletedProcess:
    code = ("import sys\nfrom backends.mlx.llm.checkpoint_source import resolve_checkpoint\n"
            f"print(resolve_checkpoint({model!r}, {revision!r}))")
    return subprocess.run([sys.executable, "-c", code], env=_env(cache), capture_output=True, text=True,
                          timeout=120)


def _etmlx(cache: Path, cwd: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "etmlx", *map(str, args)], cwd=cwd, env=_env(cache),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("revision, commit", [(None, MAIN), ("main", MAIN), ("v0", OLDER), (OLDER, OLDER)])
def test_repo_id_resolves_to_the_cached_snapshot_of_its_revision(hub_cache, revision, commit):
    ran = _resolve(hub_cache, REPO_ID, revision)
    assert ran.returncode == 0, ran.stderr[-2000:]
    snapshot = hub_cache / "models--etmlx-test--tiny-llama" / "snapshots" / commit
    assert Path(ran.stdout.strip().splitlines()[-1]) == snapshot


def test_uncached_repo_offline_is_one_line(hub_cache, tmp_path):
    ran = _etmlx(hub_cache, tmp_path, "export", "--model", "etmlx-test/not-cached")
    assert ran.returncode == 2
    assert ran.stderr.strip() == (f"etmlx: error: --model etmlx-test/not-cached is not in the Hugging Face cache "
                                  f"({hub_cache}) and HF_HUB_OFFLINE=1 is set")
    assert not list(tmp_path.iterdir())  # nothing written
    ran = _resolve(hub_cache, REPO_ID, "v9")  # a cached repo, an uncached revision
    assert ran.returncode == 1 and "at revision v9 is not in the Hugging Face cache" in ran.stderr


@pytest.mark.subprocess
def test_export_by_repo_id_offline_matches_transformers(hub_cache, tmp_path):
    """The default --out is named after the repo; the program decodes what the MAIN snapshot's model does
    (not the OLDER one's: the two differ in their first greedy tokens)."""
    ran = _etmlx(hub_cache, tmp_path, "export", "--model", REPO_ID, "--max-seq-len", "32", "--sampler", "none")
    assert ran.returncode == 0, ran.stderr[-3000:]
    pte = tmp_path / "tiny-llama.pte"
    assert pte.is_file() and "wrote tiny-llama.pte" in ran.stdout
    prompt = [5, 17, 42, 3]
    ran = _etmlx(hub_cache, tmp_path, "generate", pte, "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-tokens", "8", "--json")
    assert ran.returncode == 0, ran.stderr[-3000:]
    tokens = json.loads(ran.stdout.strip().splitlines()[-1])["tokens"]

    def greedy(model):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                 pad_token_id=0)
        return out[0, len(prompt):].tolist()

    main_tokens, older_tokens = greedy(_tiny(1)[0]), greedy(_tiny(2)[0])
    assert main_tokens != older_tokens  # the check below can tell the revisions apart
    assert tokens == main_tokens


def test_local_directory_and_bad_names(tmp_path):
    ckpt = tmp_path / "My-Model"
    ckpt.mkdir()
    assert resolve_checkpoint(str(ckpt)) == ckpt
    assert default_pte_name(str(ckpt)) == "My-Model.pte"
    assert default_pte_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen2.5-0.5B-Instruct.pte"
    with pytest.raises(CheckpointSourceError, match=r"--revision v1 applies to a Hugging Face repo id"):
        resolve_checkpoint(str(ckpt), "v1")
    with pytest.raises(CheckpointSourceError, match=r"--model \./missing does not exist"):
        resolve_checkpoint("./missing")
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(CheckpointSourceError, match="is a file, not a checkpoint directory"):
        resolve_checkpoint(str(tmp_path / "file.bin"))
    with pytest.raises(CheckpointSourceError, match="neither a local directory nor a Hugging Face repo id"):
        resolve_checkpoint("bad name!/x")


def test_an_empty_model_name_is_refused_not_the_current_directory(tmp_path, monkeypatch):
    """Path("") is ".": `--model ""` loaded the current directory (here a checkpoint-looking one) silently."""
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    for name in ("", "  "):
        with pytest.raises(CheckpointSourceError, match="--model is empty"):
            resolve_checkpoint(name)
        with pytest.raises(CheckpointSourceError, match="--model is empty"):
            default_pte_name(name)
    ran = run_cli("export", "--model", "", "--out", tmp_path / "m.pte")
    assert ran.returncode == 2 and "--model is empty" in ran.stderr and len(ran.stderr.strip().splitlines()) == 1
