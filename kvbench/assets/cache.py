"""The kvbench cache directory (``$KVBENCH_CACHE_DIR`` or ``~/.cache/kvbench``), shared by every asset kind."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("KVBENCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvbench")
    return Path(root)
