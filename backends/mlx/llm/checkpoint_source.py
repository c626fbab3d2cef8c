"""Where a checkpoint named on the command line lives: a local directory as it is, or a Hugging Face repo id
(`Qwen/Qwen2.5-0.5B-Instruct`, optionally at a revision) fetched through huggingface_hub's cache.

The download goes through `snapshot_download`, so everything huggingface_hub honours applies unchanged:
HF_HOME / HF_HUB_CACHE (where the cache is), HF_HUB_OFFLINE=1 (use the cache, never the network), HF_TOKEN
(gated and private repos), and a revision that is a branch, a tag or a commit hash. Only the files a
causal LM export reads are fetched (no .bin, .gguf or ONNX copies of the same weights).

Failures are one line naming the model: not a directory and not a valid repo id; offline and not cached;
no such repo or revision; no network.
"""

from __future__ import annotations

import sys
from pathlib import Path

# What from_pretrained reads for a model and its tokenizer (safetensors weights only: see the module docstring).
CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")
TOKENIZER_FILES = ("*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken")


class CheckpointSourceError(ValueError):
    """A checkpoint that cannot be found or fetched; the message is one line for the user."""


def is_local(name: str) -> bool:
    """Spelled as a path (absolute, ./, ../, ~, or more than one '/'), or an existing file or directory."""
    return (Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1
            or "\\" in name)


def check_named(model: str, flag: str = "--model") -> None:
    """An empty name is no checkpoint (Path("") is the current directory, which would load silently)."""
    if not isinstance(model, str) or not model.strip():
        raise CheckpointSourceError(f"{flag} is empty: give a checkpoint directory or a Hugging Face repo id")


def default_pte_name(model: str) -> str:
    """`--out` when it is left out: the repo's or directory's name, e.g. Qwen2.5-0.5B-Instruct.pte."""
    check_named(model)
    path = Path(model).expanduser()
    name = path.resolve().name if is_local(model) else model.rstrip("/").split("/")[-1]
    if not name:
        raise CheckpointSourceError(f"cannot name the .pte after {model!r}: give --out")
    return f"{name}.pte"


def resolve_checkpoint(model: str, revision: str | None = None, *, flag: str = "--model",
                       files: tuple[str, ...] = CHECKPOINT_FILES) -> Path:
    """The local directory holding `model`: the directory itself, or the cached snapshot of a repo id
    (downloaded first unless it is cached or HF_HUB_OFFLINE=1)."""
    check_named(model, flag)
    if is_local(model):
        path = Path(model).expanduser()
        if not path.is_dir():
            what = "is a file, not a checkpoint directory" if path.exists() else "does not exist"
            raise CheckpointSourceError(f"{flag} {model} {what}")
        if revision is not None:
            raise CheckpointSourceError(f"--revision {revision} applies to a Hugging Face repo id, "
                                        f"not to the local directory {model}")
        return path
    return _snapshot(model, revision, flag, files)


def _snapshot(repo_id: str, revision: str | None, flag: str, files: tuple[str, ...]) -> Path:
    # Imported here: a local directory needs none of huggingface_hub (and its import reads HF_* settings).
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    from huggingface_hub.utils import validate_repo_id

    at = f" at revision {revision}" if revision else ""
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise CheckpointSourceError(f"{flag} {repo_id} is neither a local directory nor a Hugging Face repo id "
                                    "(org/name)") from None
    if not constants.HF_HUB_OFFLINE:
        print(f"fetching {repo_id}{at} from the Hugging Face Hub (files already in {constants.HF_HUB_CACHE} "
              "are not downloaded again)", file=sys.stderr, flush=True)
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(files)))
    except LocalEntryNotFoundError:
        # Offline (HF_HUB_OFFLINE=1) or the Hub unreachable, and no complete snapshot in the cache.
        why = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the Hugging Face Hub cannot be reached"
        raise CheckpointSourceError(f"{flag} {repo_id}{at} is not in the Hugging Face cache "
                                    f"({constants.HF_HUB_CACHE}) and {why}") from None
    except GatedRepoError:
        raise CheckpointSourceError(f"{flag} {repo_id} is gated: accept its terms on huggingface.co and set "
                                    "HF_TOKEN (or run `hf auth login`)") from None
    except RevisionNotFoundError:
        raise CheckpointSourceError(f"{flag} {repo_id} has no revision {revision}") from None
    except RepositoryNotFoundError:
        raise CheckpointSourceError(f"{flag} {repo_id} is not a local directory, and the Hugging Face Hub has no "
                                    "such repo (or it is private: set HF_TOKEN)") from None


def check_weight_files(model_dir: Path) -> None:
    """Every .safetensors file in `model_dir` opens (its header parses and its tensors lie inside the file), so a
    truncated, missing or foreign weights file is one line naming it rather than a traceback from deep in
    transformers. Reads the headers only."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise CheckpointSourceError(f"{f} is not a readable safetensors file ({exc}); truncated or damaged? "
                                        "download or convert it again") from None
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, AttributeError, TypeError) as exc:
            raise CheckpointSourceError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc})") from None
        missing = sorted(s for s in shards if not (Path(model_dir) / s).is_file())
        if missing:
            raise CheckpointSourceError(f"{model_dir} lacks the weight files its index names: {', '.join(missing[:4])}")


def stored_dtype_name(model_dir: Path) -> str | None:
    """The float dtype config.json says the weights are stored in ("bfloat16", ...), or None if it names none."""
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    return name if name in ("float32", "float16", "bfloat16") else None
