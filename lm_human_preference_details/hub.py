"""Fail fast, with a fix, when a Hugging Face hub resource cannot be fetched (no network, HF_HUB_OFFLINE)."""

import os
import socket

from huggingface_hub import try_to_load_from_cache
from huggingface_hub.constants import HF_HUB_OFFLINE


class HubUnavailableError(RuntimeError):
    """A hub model or dataset was asked for, but the hub cannot be reached and nothing is cached."""


def hub_reachable(timeout: float = 3.0) -> bool:
    """True when huggingface.co answers a TCP connection within `timeout` seconds and offline mode is off."""
    if HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout):
            return True
    except OSError:
        return False


def _is_cached(repo_id: str, filename: str, repo_type: str) -> bool:
    """True when `filename` of the hub repo already sits in the local HF cache."""
    try:
        return isinstance(try_to_load_from_cache(repo_id, filename, repo_type=repo_type), str)
    except Exception:  # an invalid repo id is simply "not cached"
        return False


def check_available(name_or_path: str, flag: str, kind: str = "model", filename: str = "config.json") -> None:
    """Raise HubUnavailableError naming `flag` when `name_or_path` is neither local, cached, nor fetchable now."""
    if os.path.exists(name_or_path):
        return
    repo_type = "dataset" if kind == "dataset" else "model"
    if hub_reachable() or _is_cached(name_or_path, filename, repo_type):
        return
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.endswith((".json", ".jsonl", ".txt"))
    if looks_local and kind != "dataset":
        raise FileNotFoundError(f"{kind} path '{name_or_path}' does not exist; point {flag} at an existing directory.")
    raise HubUnavailableError(
        f"could not fetch {kind} '{name_or_path}' from the Hugging Face hub: the hub is unreachable (offline) and it "
        f"is not in the local cache. Download it on a machine with internet, e.g. `hf download {name_or_path} "
        f"{'--repo-type dataset ' if repo_type == 'dataset' else ''}--local-dir DIR`, copy DIR here and pass {flag} "
        "DIR."
    )
