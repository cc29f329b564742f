"""Where hpipe keeps what it makes once and reuses: imported models, profiles, cluster state."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$HPIPE_CACHE_DIR``, or ``~/.cache/hpipe``."""
    return Path(os.environ.get("HPIPE_CACHE_DIR") or Path.home() / ".cache" / "hpipe")
