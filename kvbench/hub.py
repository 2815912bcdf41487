"""The Hugging Face hub, asked before a download: whether it can be reached at all, so that a machine without it gets
kvbench's one-line refusal at once instead of huggingface_hub's retries (about 30 s of warnings) and then the line."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

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
