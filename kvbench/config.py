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


def git_sha(root: str | Path | None = None) -> str | None:
    """The commit of the checkout at ``root`` (default: this one), ``-dirty`` when tracked files differ from it. A
    copy of a checkout without ``.git`` (a tree sent to a GPU node) reads ``KVBENCH_GIT_SHA`` instead, which whoever
    copied it sets; else None."""
    import os
    import subprocess

    root = str(root or project_root())
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        sha = None
    if sha is None or sha.returncode != 0:
        return os.environ.get("KVBENCH_GIT_SHA") or None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def local_workers() -> int:
    """launcher=local: one worker per visible GPU, at least one."""
    import torch

    return max(1, torch.cuda.device_count())


def wandb_mode() -> str:
    """logger=wandb: WANDB_MODE if set, else online when an API key is configured, else offline."""
    import os

    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def run_id() -> str:
    """``<pid>-<4 hex>``, fixed for this process and inherited by its workers (``KVBENCH_RUN_ID``): it makes two
    sweeps started in the same second write to different sweep directories (their worker chunk files would
    otherwise overwrite each other's)."""
    import os
    import secrets

    return os.environ.setdefault("KVBENCH_RUN_ID", f"{os.getpid()}-{secrets.token_hex(2)}")


def root_config(config_name: str) -> dict:
    """conf/<config_name>.yaml as written (its defaults list, its values; nothing composed or resolved)."""
    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / f"{config_name}.yaml"), resolve=False)


def top_level_values(config_name: str = "config") -> list[str]:
    """The values conf/<config_name>.yaml sets besides its groups, in its order (a mapping's keys dotted:
    engine.compile): what ``--help`` lists and what a command line may set (``kvbench.overrides``)."""
    names = []
    for key, value in root_config(config_name).items():
        if key == "defaults":
            continue
        names += [f"{key}.{sub}" for sub in value] if isinstance(value, dict) else [key]
    return names


def help_top_level_values() -> str:
    """``--help``'s list of top-level values, read from conf/config.yaml (so it cannot go stale)."""
    return ", ".join(top_level_values())


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("kvbench_top_level_values"):
        OmegaConf.register_new_resolver("kvbench_top_level_values", help_top_level_values)
    if not OmegaConf.has_resolver("kvbench_root"):
        OmegaConf.register_new_resolver("kvbench_root", project_root)
    if not OmegaConf.has_resolver("kvbench_local_workers"):
        OmegaConf.register_new_resolver("kvbench_local_workers", local_workers)
    if not OmegaConf.has_resolver("kvbench_run_id"):
        OmegaConf.register_new_resolver("kvbench_run_id", run_id)
    if not OmegaConf.has_resolver("kvbench_wandb_mode"):
        OmegaConf.register_new_resolver("kvbench_wandb_mode", wandb_mode)


register_resolvers()
