"""OmegaConf resolvers kvbench's configs use (registered on import of kvbench.run and in tests)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

PACKAGE_DIR = Path(__file__).resolve().parent
CONF_DIR = PACKAGE_DIR.parent / "conf"


def project_root() -> str:
    """The repository root for a source checkout (where conf/ and results/ live), else ~/kvbench."""
    root = PACKAGE_DIR.parent
    if (root / "conf" / "config.yaml").exists():
        return str(root)
    return str(Path.home() / "kvbench")


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("kvbench_root"):
        OmegaConf.register_new_resolver("kvbench_root", project_root)


register_resolvers()
