"""Local folder or Hugging Face Hub id -> a local folder laid out like a Hub repo."""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_dir(path_or_id: str | Path, revision: str | None = None, what: str = "model",
                      allow_patterns: list[str] | None = None) -> Path:
    """A local folder is used as is; ``org/name`` is fetched with ``huggingface_hub.snapshot_download``."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_id)
    if path.exists():
        raise NotADirectoryError(f"{what} {text!r} is a file; pass the folder that holds config.json")
    if not HUB_ID.match(text):
        raise FileNotFoundError(f"{what} {text!r} is neither a local folder nor a Hub id of the form org/name")
    from huggingface_hub import snapshot_download

    patterns = allow_patterns or ["*.json", "*.safetensors", "*.py", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
    try:
        return Path(snapshot_download(text, revision=revision, allow_patterns=patterns))
    except Exception as e:  # the hub client raises many types; all mean "could not get it"
        raise OSError(f"could not fetch {what} {text!r} from the Hugging Face Hub ({type(e).__name__}: {e}). "
                      "Check the id and your network, or pass a local folder") from e
