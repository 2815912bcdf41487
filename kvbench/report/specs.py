"""Per-table specs (``tables.yaml``): the paper's aggregation rules and its names for kvbench's methods, as data.

A ``TableSpec`` says which ``results/paper/*.csv`` holds the table, whether kvbench can fill it (``kind``), which of
its columns the paper computes from others (``derived``, in order: category means before the average of categories)
with the paper's rounding, which other tables hold the inputs the table does not print (``sources``: DynamicKV
Table 2's averages come from Table 1's datasets, OmniKV Table 1's categories from Tables 4/5), and how its rows map
to kvbench methods where ``names.METHODS`` is not enough (ablation rows, KVCache-Factory baselines).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from kvbench.errors import ConfigError

SPECS_FILE = Path(__file__).with_name("tables.yaml")
KINDS = ("quality", "efficiency", "reference")
ROUNDINGS = ("round", "truncate", "round_or_truncate")
_TABLE_KEYS = {"file", "kind", "derived", "sources", "retained", "methods", "columns", "ours", "ours_reason",
               "exclude_labels", "notes", "delta_row", "degradation"}


@dataclass(frozen=True)
class Derived:
    """A column the paper computes as the plain mean of other columns, printed with ``decimals`` digits after
    ``rounding`` (``round``: half away from zero as printed; ``truncate``: cut; ``round_or_truncate``: the
    paper's printing matches one or the other)."""

    column: str
    of: tuple[str, ...] | str  # column ids, or "all"
    rounding: str = "round"
    decimals: int = 2

    def __post_init__(self) -> None:
        if self.rounding not in ROUNDINGS:
            raise ConfigError(f"derived column {self.column!r}: rounding={self.rounding!r}; valid: "
                              f"{', '.join(ROUNDINGS)}")
        if isinstance(self.of, str) and self.of != "all":
            raise ConfigError(f"derived column {self.column!r}: of={self.of!r} must be a list or 'all'")

    def candidates(self, value: float) -> list[float]:
        """The printed values this rule allows for an exact ``value``."""
        scale = 10**self.decimals
        rounded = math.floor(value * scale + 0.5 + 1e-9) / scale
        cut = math.floor(value * scale + 1e-9) / scale
        return {"round": [rounded], "truncate": [cut], "round_or_truncate": sorted({rounded, cut})}[self.rounding]

    def apply(self, values: list[float]) -> float:
        """The paper's printed value for these inputs (``round_or_truncate`` prints rounded)."""
        mean = sum(values) / len(values)
        return self.candidates(mean)[-1] if self.rounding != "truncate" else self.candidates(mean)[0]


@dataclass(frozen=True)
class TableSpec:
    paper: str
    table: str
    file: str
    kind: str
    derived: tuple[Derived, ...] = ()
    sources: tuple[str, ...] = ()
    retained: tuple[str, ...] = ()
    methods: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, Any] = field(default_factory=dict)
    ours: bool = True
    ours_reason: str = ""
    exclude_labels: tuple[str, ...] = ()
    notes: str = ""
    delta_row: dict[str, Any] | None = None
    degradation: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"{self.id}: kind={self.kind!r}; valid: {', '.join(KINDS)}")
        names = [d.column for d in self.derived]
        for name in self.retained:
            if name not in names:
                raise ConfigError(f"{self.id}: retained column {name!r} is not a derived column ({names})")

    @property
    def id(self) -> str:
        """``dynamickv_t1``: file stem of the rendered table."""
        return f"{self.paper.lower()}_t{self.table.split()[-1]}"

    @property
    def title(self) -> str:
        return f"{self.paper} {self.table}"

    def derived_column(self, column: str) -> Derived | None:
        return next((d for d in self.derived if d.column == column), None)


def _flatten(items: Any) -> list[dict]:
    out: list[dict] = []
    for item in items or []:
        out += _flatten(item) if isinstance(item, list) else [item]
    return out


def _spec(paper: str, table: str, raw: dict[str, Any]) -> TableSpec:
    unknown = sorted(set(raw) - _TABLE_KEYS)
    if unknown:
        raise ConfigError(f"{paper} {table}: unknown key(s) {', '.join(unknown)}; "
                          f"valid: {', '.join(sorted(_TABLE_KEYS))}")
    derived = []
    for item in _flatten(raw.get("derived")):
        of = item.get("of", "all")
        derived.append(Derived(column=str(item["column"]), of=of if isinstance(of, str) else tuple(map(str, of)),
                               rounding=item.get("rounding", "round"), decimals=int(item.get("decimals", 2))))
    return TableSpec(
        paper=paper, table=table, file=raw["file"], kind=raw["kind"], derived=tuple(derived),
        sources=tuple(raw.get("sources", ())), retained=tuple(raw.get("retained", ())),
        methods=dict(raw.get("methods") or {}), columns=dict(raw.get("columns") or {}),
        ours=bool(raw.get("ours", True)), ours_reason=raw.get("ours_reason", ""),
        exclude_labels=tuple(raw.get("exclude_labels", ())), notes=raw.get("notes", ""),
        delta_row=raw.get("delta_row"), degradation=raw.get("degradation"),
    )


@lru_cache(maxsize=2)
def load_specs(path: str = str(SPECS_FILE)) -> tuple[TableSpec, ...]:
    """Every table spec, in paper order (D2O, DynamicKV, OmniKV, KVMerger, POD) and table number."""
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    specs = [_spec(paper, table, body) for paper, tables in raw.items() if not paper.startswith("_")
             for table, body in tables.items()]
    return tuple(specs)


def get_spec(paper: str, table: str) -> TableSpec:
    for spec in load_specs():
        if spec.paper.lower() == paper.lower() and spec.table.lower() == table.lower():
            return spec
    valid = ", ".join(s.title for s in load_specs())
    raise ConfigError(f"no table {paper!r} {table!r}; valid: {valid}")


def select_specs(which: list[str] | None) -> list[TableSpec]:
    """Specs named by ``PAPER`` or ``PAPER:N`` (``DynamicKV``, ``dynamickv:1``, ``dynamickv_t1``); all when empty."""
    specs = list(load_specs())
    if not which:
        return specs
    chosen: list[TableSpec] = []
    for item in which:
        key = item.lower().replace("_t", ":")
        paper, _, number = key.partition(":")
        match = [s for s in specs if s.paper.lower() == paper and (not number or s.table.split()[-1] == number)]
        if not match:
            papers = sorted({s.paper for s in specs})
            raise ConfigError(f"--tables {item!r} names no table; use PAPER or PAPER:N with PAPER in "
                              f"{', '.join(papers)} (e.g. DynamicKV:1)")
        chosen += [s for s in match if s not in chosen]
    return chosen
