"""Config-store placeholders for methods and tasks that are registered as pending (configured, not implemented).

A paper's table names every method it compares, including baselines whose implementation has not landed. So that
an experiment still composes and its listing still shows those cells, each pending name without a YAML file gets a
``{name: <name>}`` node in Hydra's ConfigStore; planning it raises NotAvailableError ("not available yet"). The
YAML file, once it exists, is what Hydra finds first, and then no placeholder is registered for it.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from kvbench.config import CONF_DIR

PROVIDER = "kvbench (pending: not implemented yet)"


def register_pending_placeholders() -> list[str]:
    """Register a placeholder for every pending method and task that has no config file; returns their names."""
    from kvbench.methods import METHODS
    from kvbench.tasks import TASKS

    store = ConfigStore.instance()
    added = []
    for group, registry in (("method", METHODS), ("task", TASKS)):
        for name in sorted(registry.pending):
            if (CONF_DIR / group / f"{name}.yaml").exists():
                continue  # the real config exists; Hydra would otherwise use the placeholder as its schema
            store.store(group=group, name=name, node={"name": name}, provider=PROVIDER)
            added.append(f"{group}/{name}")
    return added
