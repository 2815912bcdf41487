"""The import rules of kvbench/, as data: every top-level module or package in a layer, top (the command lines) to
bottom (errors); ``tests/test_layers.py`` derives the forbidden arrows from it and walks every import (also inside
functions and under ``TYPE_CHECKING``).

* A module imports only modules of the layers below its own: never a higher layer, never a sibling (another name of
  its own layer) — siblings are independent of each other.
* ``EXCEPTIONS`` lists each arrow that runs against the order anyway, with its reason; an arrow that is neither
  downward nor listed fails the test, and so does an exception that no import uses any more.
* A new top-level module of kvbench/ fails the test until it is placed here, and the README's layout (or the docs
  page it moved to) names every placed module.

Data flows config -> jobs -> records -> scores -> tables: the command lines run jobs; a job plans, loads the model and
answers its task's requests with the engine under its method (``kvbench.jobs.answer``); tasks describe requests and
score records, and never call the engine or build a method; the store and the report read what jobs wrote.
"""

from __future__ import annotations

#: (layer name, its modules (``kvbench.<name>``; ``__init__`` is the package's own ``kvbench/__init__.py``), what it is)
LAYERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("command lines", ("run", "score"),
     "python -m kvbench.run (compose, check, run one job or a sweep, print); python -m kvbench.score (re-score a "
     "predictions file with the official-equivalent scorers)"),
    ("drivers", ("sweep", "bench", "analysis", "bundle"),
     "sweeps (plan, skip finished, launch workers); the efficiency bench; measurements that run a model and write "
     "data (POD's block maps, OmniKV's layer similarity); the offline bundle for a GPU node (its assets and the "
     "models' tokenizer)"),
    ("one job", ("jobs", "overrides"),
     "plan, run and resume one job, answer its task's requests with the engine; the command line's values checked "
     "against the methods and tasks before Hydra"),
    ("methods", ("methods",), "one dataclass per method; base.py (+ contexts.py, cache_ops.py) is the method contract"),
    ("engine", ("engine",),
     "the only code that touches transformers internals: attention functions, cache layers, the session that calls "
     "methods, generation and teacher forcing"),
    ("tasks", ("tasks",),
     "benchmarks: data, prompts as data, the requests a task with its own loop sends (requests.py), post-processing, "
     "scoring; base.py is the task contract"),
    ("report", ("report",), "tables, figures and the README's generated blocks, from stored results"),
    ("store", ("store",), "the result store: job directories, records, scores, verify"),
    ("models and scorers", ("models", "metrics"),
     "model loading (hub, local, GGUF, embedded, tiny random), dtype, EOS, chat template; official-equivalent "
     "scorers"),
    ("services", ("loggers", "registry", "hub"),
     "the W&B logger; the name -> class registry of methods and tasks; the hub's reachability"),
    ("foundations", ("assets", "config", "budget", "faults"),
     "embedded assets (models, data); the config directory and project root; the typed budget; fault injection"),
    ("base", ("errors", "layers", "__init__"),
     "kvbench's error types (one line, exit 2); these import rules; the package's version"),
)

#: (importer, imported, why): arrows against the order that are allowed; each a module (or package) prefix
EXCEPTIONS: tuple[tuple[str, str, str], ...] = (
    ("kvbench.engine", "kvbench.methods.base",
     "the engine calls the method contract (never a concrete method: tests/test_layers.py checks that too)"),
    ("kvbench.store.compression", "kvbench.methods",
     "store verify asks each stored run's method (rebuilt from meta.json, no model) where it must have compressed; "
     "the rule is the method's own (Method.expected_compression, the one the engine enforces)"),
    ("kvbench.store.verify", "kvbench.tasks",
     "store verify rebuilds the stored run's task (no data, no model) to recompute scores.json from its records"),
    ("kvbench.report.readme", "kvbench.methods",
     "the README's methods table: one row per registered method, its defaults as its class resolves them (a "
     "dataclass instance, no model, no session) and the hooks it overrides"),
    ("kvbench.report.readme", "kvbench.tasks", "the README's tasks table: the registered task each config names"),
    ("kvbench.report.store", "kvbench.methods",
     "the report names a stored run's method by the registry's classes and composition wrappers (no instance)"),
    ("kvbench.report.tables", "kvbench.methods", "the tables' method order is the registry's"),
    ("kvbench.assets.__main__", "kvbench.bundle",
     "python -m kvbench.assets bundle DIR hands over to the bundle's command line"),
)


def layer_of() -> dict[str, int]:
    """``kvbench.<name>`` -> its layer's index (0 is the top)."""
    return {f"kvbench.{name}" if name != "__init__" else "kvbench": index
            for index, (_, names, _) in enumerate(LAYERS) for name in names}


__all__ = ["EXCEPTIONS", "LAYERS", "layer_of"]
