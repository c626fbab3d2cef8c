"""The built-in demo model: a small Llama checkpoint built locally, once, with nothing downloaded.

`ensure_builtin_checkpoint(cache_dir)` returns a Hugging Face checkpoint directory (config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the chat
template) that `AutoModelForCausalLM` / `AutoTokenizer` load from the directory alone. The first call
trains the tokenizer and the model on the shipped corpus (`data/corpus.txt`): about a minute of CPU
time on one thread (longer in wall time on a busy machine); later calls only verify the cache.
`ensure_builtin_draft_checkpoint` builds a smaller model the same way (DRAFT_RECIPE, same tokenizer, in
`builtin-llama-draft`): the draft model of `etmlx bench speculative`.

The cache is trusted only while its stamp (`etmlx_builtin.json`, written last) names the current
recipe hash and the SHA-256 of every file: an interrupted build, a damaged file or a changed recipe,
corpus or library version leads to a rebuild. Builds happen in a temporary directory beside the
cache and replace it in one rename, under a file lock, so concurrent callers never see half a model.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from backends.mlx.llm.builtin.corpus import CORPUS_PATH, split_documents
from backends.mlx.llm.builtin.tokenizer import train_tokenizer
from backends.mlx.llm.builtin.training import TrainingPlan, token_stream, train
from backends.mlx.runtime import options

CHECKPOINT_NAME = "builtin-llama"
DRAFT_CHECKPOINT_NAME = "builtin-llama-draft"
STAMP = "etmlx_builtin.json"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json")
# Bump when the build code changes what it produces for the same recipe, so old caches are rebuilt.
BUILD_FORMAT = 1


@dataclass(frozen=True)
class BuiltinRecipe:
    """Everything that decides the checkpoint; its hash names a cached build."""

    vocab_size: int = 2048  # BPE target: the corpus runs out of merges earlier (about 1150 tokens)
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2  # grouped-query attention, as in current Llama models
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    steps: int = 300
    batch: int = 8
    seq_len: int = 256
    lr: float = 1e-2
    warmup: int = 20
    seed: int = 0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "lr":
                if not isinstance(value, float) or not value > 0:
                    raise ValueError(f"recipe lr must be a positive float, got {value!r}")
                continue
            least = 0 if field.name in ("warmup", "seed") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"recipe {field.name} must be an int >= {least}, got {value!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"recipe hidden_size {self.hidden_size} must split into num_heads {self.num_heads} "
                             "heads of even size (rotary embeddings pair dimensions)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"recipe num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(f"recipe seq_len {self.seq_len} exceeds max_position_embeddings "
                             f"{self.max_position_embeddings}")

    def plan(self) -> TrainingPlan:
        return TrainingPlan(steps=self.steps, batch=self.batch, seq_len=self.seq_len, lr=self.lr,
                            warmup=min(self.warmup, self.steps), seed=self.seed)

    def digest(self, corpus: bytes) -> str:
        """Hash of the recipe, the corpus, the build format and the libraries that shape the files."""
        key = {"recipe": dataclasses.asdict(self), "corpus_sha256": hashlib.sha256(corpus).hexdigest(),
               "build_format": BUILD_FORMAT, "torch": torch.__version__, "transformers": transformers.__version__,
               "tokenizers": tokenizers.__version__}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


DEFAULT_RECIPE = BuiltinRecipe()
# The draft model for speculative decoding (`etmlx bench speculative`): the same corpus and vocabulary target, so
# the same tokenizer (train_tokenizer is deterministic: `etmlx bench speculative` checks the files are equal), in
# one layer instead of two, half as wide: about 15 s of training on one thread.
DRAFT_RECIPE = BuiltinRecipe(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=192)


def default_cache_dir() -> Path:
    """$ETMLX_CACHE_DIR, else $XDG_CACHE_HOME/etmlx, else ~/.cache/etmlx."""
    if (asked := options.cache_dir()) is not None:
        return asked
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "etmlx"


def ensure_builtin_checkpoint(cache_dir: Path | str, recipe: BuiltinRecipe = DEFAULT_RECIPE,
                              corpus_path: Path | str = CORPUS_PATH, name: str = CHECKPOINT_NAME) -> Path:
    """The checkpoint directory `cache_dir/name` (builtin-llama), built first if missing, stale or damaged."""
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a path, got {type(cache_dir).__name__}")
    if not isinstance(recipe, BuiltinRecipe):
        raise TypeError(f"recipe must be a BuiltinRecipe, got {type(recipe).__name__}")
    corpus = _read_corpus(corpus_path)
    digest = recipe.digest(corpus)
    cache_dir = Path(cache_dir)
    target = cache_dir / name
    if is_valid_checkpoint(target, digest):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging_prefix, aside_prefix = f".{name}.build-", f".{name}.old-"
    with _exclusive(cache_dir / f".{name}.lock"):
        if is_valid_checkpoint(target, digest):  # another process built it while we waited
            return target
        # Holding the lock, no other build is running: what a killed one left behind can go.
        for prefix in (staging_prefix, aside_prefix):
            for leftover in cache_dir.glob(prefix + "*"):
                shutil.rmtree(leftover, ignore_errors=True)
        print(f"[builtin model] building {target} (once; cached afterwards)", file=sys.stderr, flush=True)
        staging = Path(tempfile.mkdtemp(prefix=staging_prefix, dir=cache_dir))
        try:
            _build(staging, recipe, corpus, digest)
            staging.chmod(0o755)  # mkdtemp made it private; the checkpoint is an ordinary directory
            _replace_dir(staging, target, aside_prefix)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def build_checkpoint(out_dir: Path | str, recipe: BuiltinRecipe = DEFAULT_RECIPE,
                     corpus_path: Path | str = CORPUS_PATH) -> dict:
    """Builds into `out_dir` (created; must be empty) without any caching; returns the stamp."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise ValueError(f"out_dir {out_dir} is not empty")
    corpus = _read_corpus(corpus_path)
    return _build(out_dir, recipe, corpus, recipe.digest(corpus))


def read_stamp(checkpoint: Path | str) -> dict:
    """The build record: recipe, hash, file digests, loss log, training wall and CPU seconds."""
    return json.loads((Path(checkpoint) / STAMP).read_text())


def is_valid_checkpoint(checkpoint: Path, digest: str) -> bool:
    try:
        stamp = read_stamp(checkpoint)
        if stamp.get("recipe_hash") != digest:
            return False
        files = stamp["files"]
        return all(name in files for name in REQUIRED_FILES) and all(
            _sha256(checkpoint / name) == sha for name, sha in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _build(out_dir: Path, recipe: BuiltinRecipe, corpus: bytes, digest: str) -> dict:
    documents = split_documents(corpus.decode("utf-8"))
    tokenizer = train_tokenizer(documents, recipe.vocab_size)
    tokenizer.model_max_length = recipe.max_position_embeddings
    encoded = [tokenizer(doc, add_special_tokens=False)["input_ids"] for doc in documents]
    stream = token_stream(encoded, tokenizer.bos_token_id, tokenizer.eos_token_id)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=recipe.hidden_size,
                         intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
                         num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
                         max_position_embeddings=recipe.max_position_embeddings,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, dtype="float32")
    # A private RNG scope: the caller's global torch seed is neither used nor disturbed.
    with torch.random.fork_rng(devices=[]), _one_thread():
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(config)
        started, cpu_started = time.perf_counter(), time.process_time()
        losses = train(model, stream, recipe.plan())
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    # The template goes into tokenizer_config.json, where any loader (not only transformers 5) finds it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    stamp = {"recipe_hash": digest, "recipe": dataclasses.asdict(recipe), "vocab_size": len(tokenizer),
             "corpus_tokens": int(stream.numel()), "train_seconds": round(seconds, 1),
             "train_cpu_seconds": round(cpu_seconds, 1), "first_loss": losses[0], "final_loss": losses[-1],
             "loss_log": [[step + 1, losses[step]] for step in range(0, len(losses), 10)],
             "files": {path.name: _sha256(path) for path in sorted(out_dir.iterdir()) if path.is_file()}}
    stamp_tmp = out_dir / (STAMP + ".tmp")
    stamp_tmp.write_text(json.dumps(stamp, indent=1))
    os.replace(stamp_tmp, out_dir / STAMP)
    print(f"[builtin model] trained {recipe.steps} steps in {seconds:.0f} s ({cpu_seconds:.0f} s CPU), "
          f"loss {losses[0]:.2f} -> {losses[-1]:.2f}", file=sys.stderr, flush=True)
    return stamp


def _read_corpus(corpus_path: Path | str) -> bytes:
    if not isinstance(corpus_path, (str, os.PathLike)):
        raise TypeError(f"corpus_path must be a path, got {type(corpus_path).__name__}")
    if not Path(corpus_path).is_file():
        raise FileNotFoundError(f"corpus_path {corpus_path} is not a file")
    return Path(corpus_path).read_bytes()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ensure_builtin_draft_checkpoint(cache_dir: Path | str) -> Path:
    """The built-in draft model `cache_dir/builtin-llama-draft` (DRAFT_RECIPE), built first like the demo model."""
    return ensure_builtin_checkpoint(cache_dir, DRAFT_RECIPE, name=DRAFT_CHECKPOINT_NAME)


def _replace_dir(new: Path, target: Path, aside_prefix: str) -> None:
    """Moves `new` to `target`; an old `target` is first renamed aside, so `target` is never half-written."""
    if target.is_dir() and not target.is_symlink():
        aside = Path(tempfile.mkdtemp(prefix=aside_prefix, dir=target.parent))
        os.replace(target, aside / target.name)
        shutil.rmtree(aside, ignore_errors=True)
    elif target.exists() or target.is_symlink():
        target.unlink()
    os.replace(new, target)


@contextmanager
def _one_thread():
    """Trains on one thread: this model's matrices are too small for a second thread to pay for its
    synchronisation (measured: two threads spent six times the CPU time per step on a busy machine),
    and the weights then do not depend on the machine's core count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _exclusive(lock_path: Path):
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
