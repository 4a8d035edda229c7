"""Where a worker's ``--target`` lives: a local model directory, or a Hugging Face hub id resolved
through the standard Hugging Face cache (``HF_HOME``/``HF_HUB_CACHE``; ``HF_HUB_OFFLINE=1`` reads
only the cache).

Something that looks like a path (``./x``, ``/x``, ``~/x``, ``a/b/c``) is a directory and never
goes to the hub, so a typo fails at once instead of after hub retries.
"""

from __future__ import annotations

import json
from pathlib import Path

# What a worker needs from a hub snapshot: config and weights (safetensors first), tokenizer files
# (vllm and sglang load one), and remote code for --trust-remote-code.
_HUB_FILES = ["*.json", "*.safetensors", "*.py", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
_HUB_FALLBACK_WEIGHTS = ["*.bin"]


def looks_like_path(target: str) -> bool:
    """True unless ``target`` could be a hub id (``name`` or ``org/name``)."""
    if target.startswith(("/", ".", "~")) or target.count("/") > 1 or "\\" in target:
        return True
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(target)
    except HFValidationError:
        return True
    return False


def resolve_target(target: str) -> tuple[Path, str | None]:
    """The local model directory for ``target``, and the model name to report for it (a hub id; None
    for a directory, whose engines name it after the directory). ``ValueError`` with the fix otherwise."""
    path = Path(target).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"target directory {target} holds no config.json: not a model checkpoint")
        return path, None
    if path.exists():
        raise ValueError(f"target {target} is a file; --target takes a model directory or a Hugging Face hub id")
    if looks_like_path(target):
        raise ValueError(f"target directory {target} does not exist")
    return _from_hub(target), target


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
        if not any(path.glob("*.safetensors")):
            path = Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES + _HUB_FALLBACK_WEIGHTS))
    except GatedRepoError:
        raise ValueError(f"{repo_id!r} is a gated model: accept its license on huggingface.co and log in "
                         f"(hf auth login), or pass a local directory") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{repo_id!r} is neither a local directory nor a model on the Hugging Face hub "
                         f"(a private one needs hf auth login)") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise ValueError(f"{repo_id!r} is neither a local directory nor in the Hugging Face cache "
                         f"({constants.HF_HUB_CACHE}), and {why}") from None
    if not (path / "config.json").is_file():
        raise ValueError(f"hub model {repo_id!r} has no config.json (at {path})")
    return path


def num_hidden_layers(path: Path) -> int | None:
    """The decoder depth a checkpoint's config.json names, if it names one at the top level."""
    try:
        value = json.loads((path / "config.json").read_text()).get("num_hidden_layers")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None
