"""Finding and reading EleutherAI's lm-evaluation-harness without importing it (validation stays fast).

kvbench pins ``lm-eval==0.4.13`` (``[lmeval]`` extra): it drives lm-eval's task objects directly (``ConfigurableTask``,
``build_all_requests``, filter ensembles, ``_compute_task_aggregations``), whose internals may change between releases.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from kvbench.errors import NotAvailableError

LM_EVAL_PIN = "lm-eval==0.4.13"
INSTALL_HINT = f"pip install -e .[lmeval] ({LM_EVAL_PIN})"
BOOTSTRAP_ITERS = 100000  # lm-eval's default; closed-form stderr for mean metrics
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")


def tasks_dir() -> Path:
    """lm-eval's installed ``lm_eval/tasks`` folder, found without importing lm-eval (NotAvailableError if absent)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise NotAvailableError(f"this task runs through EleutherAI's lm-evaluation-harness, which is not installed; "
                                f"run: {INSTALL_HINT}")
    return Path(list(spec.submodule_search_locations)[0]) / "tasks"


def read_task_yaml(path: Path) -> dict[str, Any]:
    """An lm-eval task YAML as data (``!function`` tags kept as strings, ``include`` merged under the file)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)  # noqa: S506 (SafeLoader subclass)
    include = cfg.pop("include", None)
    if include is None:
        return cfg
    merged: dict[str, Any] = {}
    for name in include if isinstance(include, list) else [include]:
        merged.update(read_task_yaml(path.parent / name))
    return {**merged, **cfg}


def plain(value: Any) -> Any:
    """JSON-friendly: numpy scalars to Python numbers, tuples to lists."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict, str)):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


__all__ = ["BOOTSTRAP_ITERS", "INSTALL_HINT", "LM_EVAL_PIN", "SPLIT_KEYS", "plain", "read_task_yaml", "tasks_dir"]
