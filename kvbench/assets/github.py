"""Files pinned in public GitHub repositories, fetched from GitHub raw at a pinned commit and checked against a sha256
pinned here: TriAttention's published statistics (``TRIATTENTION_STATS``, named ``authors:<dir>/<model>`` in
``method.stats_path``).

Resolution: the kvbench cache (``$KVBENCH_CACHE_DIR`` or ``~/.cache/kvbench``,
``assets/github/<owner>+<repo>-<commit[:12]>/<path>``), else a download from
``https://raw.githubusercontent.com/<repo>/<commit>/<path>`` published only once its sha256 matches (a mismatch
refuses in one line and stores nothing). ``python -m kvbench.assets triattention`` fetches them all ahead of an
offline run; a node without the network and without the file refuses in one line naming the asset, where to put the
file and the fetch command.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvbench.assets.cache import cache_dir
from kvbench.errors import ConfigError, DataError, NotAvailableError


@dataclass(frozen=True)
class GitHubFile:
    """One file of ``repo`` at ``commit``, its sha256 (computed from the repository's bytes) and what it fits."""

    name: str  # the catalog name, e.g. for_aime25_experiment/qwen3_8b
    repo: str
    commit: str
    path: str
    sha256: str
    fits: str  # the model it was calibrated on (its metadata's model_name) and its shape

    @property
    def url(self) -> str:
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.path}"

    @property
    def file_name(self) -> str:
        return Path(self.path).name


TRIATTENTION_REPO = "WeianMao/triattention"
TRIATTENTION_COMMIT = "c3744ee6a50522a1559a577f85aef2b165a344f2"
#: ``triattention/calibration/for_aime2{4,5}_experiment/*.pt`` (docs/calibration.md; Apache-2.0, the repository's
#: LICENSE); sha256 of the bytes at the pinned commit; fits read from each file's metadata and sampled heads
_FITS = {"qwen3_8b": "Qwen/Qwen3-8B: 36 layers, 32 query heads, head_dim 128, rope half",
         "ds_qwen7b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B: 28 layers, 28 query heads, head_dim 128, rope half",
         "ds_llama8b": "deepseek-ai/DeepSeek-R1-Distill-Llama-8B: 32 layers, 32 query heads, head_dim 128, rope half"}
_SHA256 = {
    "for_aime24_experiment/qwen3_8b": "6d645cf183904d0aba7703b68ed9c4f1ec38d38094a1a84443c3da2287fea031",
    "for_aime24_experiment/ds_qwen7b": "9c5e092da5008201a573e2262781268dbfc3aef9d8d4bb4923896b80788081d6",
    "for_aime24_experiment/ds_llama8b": "60d156e724380b237569c869abe6bef9ba226a995de10423b8879b59d9318bdc",
    "for_aime25_experiment/qwen3_8b": "1d133d9d3f6a4283a1bd72db2fe99f4515fd11367d2c172de999e34cc94bd391",
    "for_aime25_experiment/ds_qwen7b": "a9f39c491ddb23639cdb5f02a89f201147add2d3cf0cfc6e08e5ff52163e82d7",
    "for_aime25_experiment/ds_llama8b": "812b3359647782b7a0743a0a41a895f9f3bf95c15a787cc36131220ead8f7239",
}
TRIATTENTION_STATS: dict[str, GitHubFile] = {
    name: GitHubFile(name, TRIATTENTION_REPO, TRIATTENTION_COMMIT, f"triattention/calibration/{name}.pt", sha,
                     _FITS[name.split("/")[1]])
    for name, sha in _SHA256.items()
}
#: the prefix naming a catalog entry in ``method.stats_path``
AUTHORS_PREFIX = "authors:"


def named_stats(value: str) -> GitHubFile | None:
    """The catalog entry ``stats_path`` names (``authors:<name>``), None for a local path; an unknown name refuses in
    one line naming the valid ones."""
    if not value.startswith(AUTHORS_PREFIX):
        return None
    name = value[len(AUTHORS_PREFIX):]
    if name not in TRIATTENTION_STATS:
        raise ConfigError(f"method 'triattention': stats_path={value!r} is not a published statistics file; valid: "
                          + ", ".join(AUTHORS_PREFIX + n for n in TRIATTENTION_STATS) + ", or a local .pt path")
    return TRIATTENTION_STATS[name]


def cached_path(asset: GitHubFile) -> Path:
    return (cache_dir() / "assets" / "github" / f"{asset.repo.replace('/', '+')}-{asset.commit[:12]}"
            / asset.path)


def _download(url: str, dest: Path) -> None:
    """``url`` into ``dest`` (the network's only caller here: tests replace it)."""
    with urllib.request.urlopen(url, timeout=60) as response, open(dest, "wb") as out:  # noqa: S310 - pinned https
        while block := response.read(1 << 20):
            out.write(block)


def fetch_file(asset: GitHubFile, download: bool = True) -> Path:
    """The cached, sha256-checked file of ``asset``, downloading it once when it is not cached."""
    target = cached_path(asset)
    where = (f"put {asset.file_name} (sha256 {asset.sha256}, from {asset.url}) at {target}, or run: "
             f"python -m kvbench.assets {AUTHORS_PREFIX}{asset.name}")
    if target.is_file():  # a file put there by hand is checked too: the job key names the pinned bytes
        digest = hashlib.sha256(target.read_bytes()).hexdigest()
        if digest != asset.sha256:
            raise DataError(f"asset {AUTHORS_PREFIX}{asset.name} at {target} has sha256 {digest}, expected "
                            f"{asset.sha256}; remove it and {where.split(', or ')[-1]}")
        return target
    if not download:
        raise NotAvailableError(f"asset {AUTHORS_PREFIX}{asset.name} is not cached and downloads are off; {where}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        staging = Path(tmp) / asset.file_name
        try:
            _download(asset.url, staging)
        except OSError as exc:  # no network, DNS, HTTP errors (urllib's are OSErrors)
            raise NotAvailableError(f"asset {AUTHORS_PREFIX}{asset.name} could not be downloaded "
                                    f"({type(exc).__name__}: {exc}); {where}") from None
        digest = hashlib.sha256(staging.read_bytes()).hexdigest()
        if digest != asset.sha256:
            raise DataError(f"asset {AUTHORS_PREFIX}{asset.name} downloaded from {asset.url} has sha256 {digest}, "
                            f"expected {asset.sha256}; nothing was kept")
        os.replace(staging, target)  # atomic: readers see no file or the whole verified file
    return target
