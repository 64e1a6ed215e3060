"""What a ``model.path`` names: a local folder, or a hub id whose files are already in the local HF cache.

transformers resolves a hub id itself, but only by asking whether the string is a folder first; the loader
here used to refuse every string with a ``/`` that was not a folder, and every hub id has one. The rule now,
in one place for the trainer (:func:`cope.models.policy.load_pretrained`) and the vLLM server it starts
(:mod:`cope.rollout.vllm.server`): an existing local path is that path; a valid hub id is its snapshot folder
in the HF cache (``huggingface_hub.snapshot_download(..., local_files_only=True)``: ``$HF_HOME/hub``, never
the network); anything else is one :class:`FileNotFoundError` that names both fixes. Torch-free.
"""
from __future__ import annotations

from pathlib import Path


def hub_cache_dir() -> str:
    """The HF cache folder this process reads (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def is_hub_id(path: str) -> bool:
    """``Org/Name`` or ``name`` as the hub spells ids (not ``/abs``, ``./rel``, ``~/x`` or ``a/b/c``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if path.startswith((".", "~")):
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def cached_snapshot(repo_id: str) -> Path | None:
    """The folder of ``repo_id``'s cached snapshot (its ``main`` revision), or None when it is not in the cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def resolve_model_path(path: str, local_files_only: bool = True) -> str:
    """What ``from_pretrained`` loads for ``model.path=path``: an existing local path as given, a hub id's
    cached snapshot folder (``local_files_only``; else the id itself, for transformers to download).

    Raises:
        FileNotFoundError: neither a local path nor (with ``local_files_only``) a hub id in the cache; the
            message says how to fix either way, with the id and the cache folder.
    """
    if Path(path).expanduser().exists():  # a local folder stays a folder, even one named like Org/Name
        return str(Path(path).expanduser())
    hub_id = is_hub_id(path)
    if hub_id and not local_files_only:
        return path
    snapshot = cached_snapshot(path) if hub_id else None
    if snapshot is not None:
        return str(snapshot)
    download = (f"download it once where the network is available, `huggingface-cli download {path}`, into the HF "
                f"cache this run reads ({hub_cache_dir()}; set HF_HOME to train from another cache)") if hub_id else \
        ("use a hub id whose files are in the HF cache (`huggingface-cli download <id>` where the network is "
         f"available; this run reads {hub_cache_dir()}, set HF_HOME for another)")
    raise FileNotFoundError(f"model.path {path!r} is neither a local folder nor a model in the local HF cache (nothing is "
                            f"downloaded at run time): {download}, or set model.path to a local folder that holds the "
                            "model (config.json, weights, tokenizer files)")
