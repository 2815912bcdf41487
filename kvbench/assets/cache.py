"""The kvbench cache directory (``$KVBENCH_CACHE_DIR`` or ``~/.cache/kvbench``), shared by every asset kind."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("KVBENCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvbench")
    return Path(root)


@contextmanager
def building(target: Path) -> Iterator[None]:
    """Held while one process builds ``target`` (a download, an assembly, a conversion) in a cache that others share:
    an exclusive lock, so workers on one machine that start together (a sweep's local workers, test workers) build it
    once and the others wait, then find it built (callers check again inside). The lock file lives in this machine's
    temp directory (named by ``target``'s path; nothing is added to the cache). Where file locks are not available
    (not POSIX, or no writable temp directory) it holds nothing: each process builds and the atomic publish keeps
    one copy, as it does between machines that share a cache."""
    try:
        import fcntl

        locks = Path(tempfile.gettempdir()) / f"kvbench-locks-{os.getuid()}"
        locks.mkdir(exist_ok=True)
        digest = hashlib.sha256(str(target.resolve()).encode()).hexdigest()[:16]
        lock = open(locks / f"{target.name}-{digest}.lock", "a")
    except (ImportError, OSError):  # pragma: no cover - not POSIX, or no temp directory to write
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logging.getLogger("kvbench").warning("kvbench: waiting for another process building %s", target)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
