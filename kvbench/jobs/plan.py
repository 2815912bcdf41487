"""Plan one job: validate the composed config and build the key its results are stored under. Never loads a model or
data, so a sweep of hundreds of jobs is checked in milliseconds (``kvbench.sweep`` plans with it too)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench.budget import Budget, check_budget, parse_budget
from kvbench.errors import ConfigError, NotAvailableError


@dataclass
class Job:
    """A fully validated job: everything needed to run it, nothing loaded yet."""

    cfg: DictConfig
    budget: Budget
    method: Any
    task: Any
    spec: Any
    key: dict[str, Any]
    parts: tuple[str, str, str, str]
    #: how decode steps run, resolved from engine.decode / engine.compile: "graph" (one captured step per token,
    #: kvbench/engine/graph.py) or "eager" (the host-driven per-layer path)
    decode: str = "eager"
    #: sampled decoding (kvbench/engine/sampling.py), resolved from the task's protocol and the top-level ``sampling``;
    #: None: greedy
    sampling: Any = None

    @property
    def budget_label(self) -> str:
        return self.parts[3]


def plan_job(cfg: DictConfig) -> Job:
    """Validate the composed config and build the job key. Never loads a model or data."""
    from kvbench.engine.architecture import SLIDING_POLICIES
    from kvbench.engine.options import POSITION_MODES
    from kvbench.methods import build_method
    from kvbench.models import spec_from_config
    from kvbench.tasks import build_task

    method_cfg = OmegaConf.to_container(cfg.method, resolve=True)
    budget = parse_budget(cfg.budget, method_cfg.get("name"))  # the job's one parse; the typed value from here on
    missing, method, task = [], None, None
    try:
        method = build_method(method_cfg, budget)
    except NotAvailableError as exc:
        missing.append(str(exc).split("; implemented")[0])
    try:
        task = build_task(OmegaConf.to_container(cfg.task, resolve=True))
    except NotAvailableError as exc:
        missing.append(str(exc).split("; implemented")[0])
    if missing:  # say everything that is missing at once, not one piece per attempt
        raise NotAvailableError(" and ".join(missing))
    spec = spec_from_config(OmegaConf.to_container(cfg.model, resolve=True))
    # a ratio resolves per prompt: one below the method's minimum even on the model's longest prompt (the protocol's
    # truncation length, or the context window a task's truncate_to may reach) is below it on every prompt it
    # compresses; the session checks each prompt's own length
    longest = max(spec.max_input_tokens or 0, spec.context_length)
    check_budget(budget, method, longest, f"even on the longest prompt model {spec.name!r} takes ({longest} tokens)")
    if method.requires_cuda:
        _check_cuda_method(method.name, spec)
    if cfg.position_mode not in POSITION_MODES:
        raise ConfigError(f"position_mode={cfg.position_mode!r} is not valid; valid: {', '.join(POSITION_MODES)}")
    sliding_layers = cfg.get("sliding_layers", "auto")
    if sliding_layers not in SLIDING_POLICIES:
        raise ConfigError(f"sliding_layers={sliding_layers!r} is not valid; valid: {', '.join(SLIDING_POLICIES)}")
    for name in ("batch_size", "seed"):
        value = cfg[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "batch_size" else 0):
            raise ConfigError(f"{name}={value!r} must be an integer >= {1 if name == 'batch_size' else 0}")
    if cfg.limit is not None and (not isinstance(cfg.limit, int) or cfg.limit < 1):
        raise ConfigError(f"limit={cfg.limit!r} must be a positive integer or null")
    if cfg.batch_size > 1 and not method.supports_batching:
        raise ConfigError(f"method {method.name!r} is defined per sequence; use batch_size=1 (got {cfg.batch_size})")
    task = _follow_turns(cfg, task)
    question, turns, history = _question_protocol(cfg, task, method)
    sampling = resolve_sampling(cfg, task, question)
    decode = resolve_decode(cfg, method, budget, task, spec, question)
    label = method.budget_label(budget) or budget.label()  # POD's window, not the unused budget, names its jobs
    model_key = {k: v for k, v in asdict(spec).items() if k not in ("device", "notes")}
    key = {
        "kvbench_result_format": 1,
        "model": model_key,
        "method": method.describe(),
        "budget": label,
        "task": {**task.protocol(), "fields": _task_fields(task)},
        "position_mode": cfg.position_mode,
        # the default (auto) is left out of the key: results stored before the option existed keep their hash
        **({"sliding_layers": sliding_layers} if sliding_layers != "auto" else {}),
        # the captured decode: other kernels over fixed-capacity layers (in bf16 its tokens may part from the
        # host-driven path's after the first few; its bytes and resident curve are the same: entries, not slots)
        **({"engine_compile": True} if decode == "graph" else {}),
        # left out at their defaults (with_context, one turn): results stored before the options existed keep their hash
        **({"question": question} if question != "with_context" else {}),
        **({"turns": turns, "turn_history": history} if turns > 1 else {}),
        # left out when greedy (every job before sampled decoding existed): their results keep their hash
        **({"sampling": sampling.describe()} if sampling is not None else {}),
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
    }
    return Job(cfg, budget, method, task, spec, key, (spec.name, task.name, method.name, label), decode, sampling)


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "n")


def resolve_sampling(cfg: DictConfig, task: Any, question: str = "with_context") -> Any:
    """The job's ``Sampling`` (kvbench/engine/sampling.py), or None for greedy: the task's declared ``sampling``
    (its reference evaluation's settings, a task attribute; absent on most tasks) updated by the non-null fields of
    the top-level ``sampling`` group. Greedy unless the result sets a temperature > 0. Refused in one line: a bad
    value, a field the top level names that is not a sampling setting, n > 1 or a top-level top_p / top_k while
    greedy, and sampling where the job cannot sample (a task with its own evaluation loop, a staged question)."""
    import dataclasses

    from kvbench.engine.sampling import Sampling, invalid

    declared = getattr(task, "sampling", None) or {}
    given = cfg.get("sampling") or {}
    if not hasattr(declared, "items"):
        raise ConfigError(f"task {task.name!r}: sampling={declared!r} must be a mapping of "
                          f"{', '.join(SAMPLING_FIELDS)}")
    given = OmegaConf.to_container(given, resolve=True) if isinstance(given, DictConfig) else dict(given)
    for source, values in (("sampling", given), ("task.sampling", dict(declared))):
        unknown = sorted(set(values) - set(SAMPLING_FIELDS))
        if unknown:
            raise ConfigError(f"{source}.{unknown[0]} is not a sampling setting; valid: {', '.join(SAMPLING_FIELDS)}")
    merged = {k: v for k, v in dict(declared).items() if v is not None}
    merged.update({k: v for k, v in given.items() if v is not None})
    temperature = merged.get("temperature")
    if temperature is None or (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
                               and temperature == 0):
        n = merged.get("n", 1)
        if n != 1:
            raise ConfigError(f"sampling.n={n!r} needs sampling (a sampling.temperature > 0); greedy decoding gives "
                              "one answer per prompt: set sampling.n=1 or a temperature")
        for name in ("top_p", "top_k"):
            if given.get(name) is not None:
                raise ConfigError(f"sampling.{name}={given[name]!r} needs sampling (a sampling.temperature > 0); "
                                  "greedy decoding ignores it")
        return None
    settings = {**{f.name: f.default for f in dataclasses.fields(Sampling)}, **merged}
    problem = invalid(*(settings[name] for name in SAMPLING_FIELDS))
    if problem:
        raise ConfigError(problem)
    if task.own_loop():
        raise ConfigError(f"task {task.name!r} runs its own evaluation loop (teacher forcing or its own requests), "
                          "which decodes greedily; sampling applies to generated tasks: drop the sampling settings")
    if question != "with_context":
        raise ConfigError("sampling with question=after_compression or turns > 1 is not supported (the staged "
                          "question decodes greedily); use question=with_context or drop the sampling settings")
    # 1 and 1.0 are one setting (and one job key)
    return Sampling(temperature=float(settings["temperature"]), top_p=float(settings["top_p"]),
                    top_k=settings["top_k"], n=settings["n"])


QUESTION_MODES = ("with_context", "after_compression")
TURN_HISTORY = ("keep", "rollback")


def staged(cfg: DictConfig) -> bool:
    """Whether the job feeds the question after the compressed context (question=after_compression, or turns > 1)."""
    return cfg.get("question", "with_context") == "after_compression" or int(cfg.get("turns", 1) or 1) > 1


def _follow_turns(cfg: DictConfig, task: Any) -> Any:
    """A multi-turn task asks the top-level ``turns`` questions per sample: its ``turns`` field follows it (a
    ``task.turns`` other than its default and ``turns`` is refused rather than ignored)."""
    import dataclasses

    turns = cfg.get("turns", 1)
    if not task.multi_turn or isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        return task
    default = next(f.default for f in dataclasses.fields(task) if f.name == "turns")
    if task.turns not in (default, turns):
        raise ConfigError(f"task {task.name!r}: task.turns={task.turns} but turns={turns}; set turns only (the "
                          "task asks that many questions per sample)")
    return dataclasses.replace(task, turns=turns)


def _question_protocol(cfg: DictConfig, task: Any, method: Any) -> tuple[str, int, str]:
    """``question``, ``turns`` and ``turn_history`` checked against the task and the method (turns > 1 implies
    question=after_compression): (question, turns, history)."""
    question, turns = cfg.get("question", "with_context"), cfg.get("turns", 1)
    history = cfg.get("turn_history", "keep")
    if question not in QUESTION_MODES:
        raise ConfigError(f"question={question!r} is not valid; valid: {', '.join(QUESTION_MODES)}")
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ConfigError(f"turns={turns!r} must be an integer >= 1")
    if history not in TURN_HISTORY:
        raise ConfigError(f"turn_history={history!r} is not valid; valid: {', '.join(TURN_HISTORY)}")
    if turns > 1:
        question = "after_compression"
        if not task.multi_turn:
            multi = _tasks_with("multi_turn")
            raise ConfigError(f"task {task.name!r} asks one question per sample (turns={turns}); multi-turn tasks: "
                              f"{', '.join(multi)}")
    if question == "with_context":
        return question, turns, history
    if not task.separable_question:
        can = _tasks_with("separable_question")
        raise ConfigError(f"task {task.name!r} cannot separate its question from the context "
                          f"(question=after_compression); tasks that can: {', '.join(can)}")
    parts = task.inseparable()
    if parts:
        raise ConfigError(f"task {task.name!r} cannot separate the question of {', '.join(parts)} from the context "
                          f"(question=after_compression); drop {'it' if len(parts) == 1 else 'them'} from its datasets")
    if not method.supports_continued_forward:
        raise ConfigError(f"method {method.name!r} cannot take the question as a continued multi-token forward after "
                          "its compression (its decode attention is single-query); use question=with_context")
    if cfg.batch_size != 1:
        raise ConfigError(f"question=after_compression runs one sequence at a time; use batch_size=1 "
                          f"(got {cfg.batch_size})")
    if turns > 1 and history == "rollback" and (method.decode_state_outside_cache or method.needs_logits):
        raise ConfigError(f"turn_history=rollback restores the cache layers only; method {method.name!r} keeps decode "
                          "state outside them; use turn_history=keep")
    return question, turns, history


def _tasks_with(flag: str) -> list[str]:
    """Registered tasks whose class sets ``flag`` (a task whose module cannot import here, e.g. without an extra, is
    left out)."""
    from kvbench.tasks import TASKS

    names = []
    for name in TASKS.names():
        try:
            if getattr(TASKS.get_class(name), flag, False):
                names.append(name)
        except Exception:  # noqa: BLE001 - an optional dependency missing: not listable here
            continue
    return names


def _check_cuda_method(method: str, spec: Any) -> None:
    """A method that moves KV between host and GPU (``requires_cuda``) refuses a model that would run elsewhere."""
    from kvbench.models import resolve_device

    device = resolve_device(spec.device)
    if device != "cuda":
        why = "torch sees no CUDA device here" if spec.device == "auto" else f"model.device={spec.device!r}"
        raise NotAvailableError(
            f"method {method!r} needs the model on a CUDA device (it offloads KV to host memory and prefetches it "
            f"on a side CUDA stream); model {spec.name!r} would run on {device!r} ({why}); run it on a GPU machine "
            "with model.device=auto or cuda"
        )


def _task_fields(task: Any) -> dict[str, Any]:
    import dataclasses

    if not dataclasses.is_dataclass(task):
        return {}
    unset = {name for name in getattr(task, "keyed_when_set", ()) if getattr(task, name) is None}
    return {f.name: getattr(task, f.name) for f in dataclasses.fields(task)
            if f.name != "data_dir" and f.name not in unset}


def _engine_compile(cfg: DictConfig) -> bool:
    value = (cfg.get("engine") or {}).get("compile", False)
    if not isinstance(value, bool):
        raise ConfigError(f"engine.compile={value!r} must be true or false")
    return value


DECODE_MODES = ("auto", "graph", "eager")


def resolve_decode(cfg: DictConfig, method: Any, budget: Budget, task: Any, spec: Any, question: str) -> str:
    """``engine.decode``: ``graph`` (one captured step per token), ``eager`` (the host-driven path) or ``auto`` (graph
    where the model runs on CUDA and the job can take it, with one log line where it cannot; eager on a CPU, where
    a captured step saves nothing). ``engine.compile=true`` is ``engine.decode=graph``. A graph the job cannot take
    is refused in one line, before any model loads."""
    import logging

    mode = (cfg.get("engine") or {}).get("decode", "auto")
    if mode not in DECODE_MODES:
        raise ConfigError(f"engine.decode={mode!r} is not valid; valid: {', '.join(DECODE_MODES)}")
    compiled = _engine_compile(cfg)
    if compiled:
        if mode == "eager":
            raise ConfigError("engine.compile=true is engine.decode=graph; it contradicts engine.decode=eager")
        mode = "graph"
    if mode == "eager":
        return "eager"
    if mode == "graph":
        why = _no_graph(cfg, method, budget, task, spec, question)
        if why is not None:
            setting, instead = ("engine.compile=true", "engine.compile=false") if compiled else \
                ("engine.decode=graph", "engine.decode=eager")
            raise ConfigError(f"{setting}: {why}; use {instead}")
        return "graph"
    from kvbench.models import resolve_device

    if resolve_device(spec.device) != "cuda":
        return "eager"  # before asking why not (a model's config is read there): a CPU decodes host-driven anyway
    why = _no_graph(cfg, method, budget, task, spec, question)
    if why is not None:
        logging.getLogger("kvbench").info("engine.decode=auto decodes on the host-driven path: %s", why)
        return "eager"
    return "graph"


def _no_graph(cfg: DictConfig, method: Any, budget: Budget, task: Any, spec: Any, question: str) -> str | None:
    """Why this job's decode cannot be one captured step per token, or None."""

    if question != "with_context":
        return ("question=after_compression feeds a multi-token forward after prefill, which the captured decode "
                "step does not take")
    if task.own_loop():
        return f"task {task.name!r} runs its own forwards (teacher forcing or its own generation loop)"
    if cfg.position_mode == "compact":
        return "position_mode=compact re-rotates the kept keys at every step on the host"
    if not budget.is_full and method.decode_compression_spec() is not None:
        from kvbench.engine.decode_compression import graph_refusal

        refusal = graph_refusal(method, method.decode_compression_spec(), budget)
        if refusal is not None:
            return f"method {method.name!r} compresses during decode (decode_compression) and {refusal}"
    if not budget.is_full and not method.has_static_step():
        return f"method {method.name!r} has no captured decode step ({method.static_refusal()})"
    if not budget.is_full:
        return _sliding_refusal(cfg, spec)
    return None


def _sliding_refusal(cfg: DictConfig, spec: Any) -> str | None:
    """Why a method may not act inside the model's sliding windows in the captured step, read from the model's config
    (``model_config``: from the hub only where the model runs on CUDA, as it is about to load there; a config this
    machine cannot read leaves it to the session, which refuses when the model is loaded)."""
    from kvbench.engine.architecture import compressed_layers, config_layer_windows, resolve_policy
    from kvbench.models import resolve_device
    from kvbench.models.loading import model_config

    config = model_config(spec, network=resolve_device(spec.device) == "cuda")
    specs = config_layer_windows(config) if config is not None else None
    if not specs:
        return None
    policy = cfg.get("sliding_layers", "auto")
    if not any(specs[i].sliding for i in compressed_layers(specs, resolve_policy(policy, specs))):
        return None
    sliding = sum(s.sliding for s in specs.values())
    return (f"model {spec.name!r} slides on {sliding} of its {len(specs)} layers and sliding_layers={policy} lets "
            "the method act inside their windows, which the captured step does not run (sliding_layers=window leaves "
            "those layers to their window)")

