"""The Hugging Face hub, asked before a download: whether it can be reached at all, so that a machine without it gets
kvbench's one-line refusal at once instead of huggingface_hub's retries (about 30 s of warnings) and then the line.

The task loaders that fetch official files from a hub dataset (LongBench, LEval, ZeroSCROLLS, InfiniteBench, PG-19)
share the refusal's wording here: ``task 't': could not download <what> (<why>); <how to give local files>``."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from kvbench.errors import DataError

_PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be reached now (offline mode, no name resolution, no connection within ``timeout``), else
    None. Behind a proxy the direct probe proves nothing: None (the download says what happens)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(name) for name in _PROXIES):
        return None
    endpoint = urlparse(constants.ENDPOINT)
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return f"{host}:{port} cannot be reached: {exc.strerror or exc}"
    return None


def refusal(task: str, what: str, reason: str, remedy: str) -> DataError:
    """The one line of a download that cannot happen: ``task 't': could not download <what> (<reason>); <remedy>``,
    where ``remedy`` says how to give the files locally (``task.data_dir``)."""
    return DataError(f"task {task!r}: could not download {what} ({reason}); {remedy}")


def failure(exc: BaseException) -> str:
    """An exception of the hub client as a short reason on one line (its messages span lines)."""
    reason = " ".join(str(exc).split())[:200] or type(exc).__name__
    return f"{type(exc).__name__}: {reason}"


def require_hub(task: str, what: str, remedy: str) -> None:
    """Refuse at once (``refusal``) when the hub cannot be reached, before any network call of the hub client."""
    reason = hub_unreachable()
    if reason:
        raise refusal(task, what, reason, remedy)


def dataset_file(task: str, repo: str, filename: str, remedy: str, revision: str | None = None) -> Path:
    """``filename`` of the hub dataset ``repo`` (at commit ``revision``, or the default branch when None): from the
    hub cache when it is there (no network: offline, the hub client would retry for ~30 s before falling back to it),
    else downloaded once after ``require_hub``. Any failure is one ``refusal`` line."""
    import huggingface_hub

    request = {"repo_id": repo, "filename": filename, "repo_type": "dataset"}
    if revision is not None:
        request["revision"] = revision
    try:
        return Path(huggingface_hub.hf_hub_download(**request, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or an unreadable cache): download
        pass
    what = f"{filename} of the hub dataset {repo}"
    require_hub(task, what, remedy)
    try:
        return Path(huggingface_hub.hf_hub_download(**request))
    except Exception as exc:  # offline, gated, renamed: all mean "use a local copy"
        raise refusal(task, what, failure(exc), remedy) from None


def dataset_snapshot(task: str, repo: str, patterns: list[str], remedy: str, revision: str | None = None) -> Path:
    """The files of the hub dataset ``repo`` matching ``patterns`` (at ``revision``, or the default branch), as a
    local folder: the hub cache first, else downloaded once after ``require_hub``; any failure is one ``refusal``
    line. For datasets whose data file names are the hub's (``data/train-00000-of-00001.parquet``), not the
    benchmark's."""
    import huggingface_hub

    request = {"repo_id": repo, "repo_type": "dataset", "allow_patterns": patterns, "revision": revision}
    try:
        return Path(huggingface_hub.snapshot_download(**request, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached: download
        pass
    what = f"the hub dataset {repo}"
    require_hub(task, what, remedy)
    try:
        return Path(huggingface_hub.snapshot_download(**request))
    except Exception as exc:
        raise refusal(task, what, failure(exc), remedy) from None


__all__ = ["dataset_file", "dataset_snapshot", "failure", "hub_unreachable", "refusal", "require_hub"]
