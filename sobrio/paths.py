"""Where sobrio keeps what it derives (prepared model files, sealed KV blocks, pinned Skills): one root that
every layer may ask for, `$SOBRIO_CACHE` or `~/.cache/sobrio`. Never user data in the clear."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where sobrio keeps derived model files (never user data)."""
    root = os.environ.get("SOBRIO_CACHE") or os.path.join(Path.home(), ".cache", "sobrio")
    return Path(root)
