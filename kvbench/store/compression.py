"""Did a stored job of a compressing method really compress? Read from its records, not assumed.

transformers 5.24 renamed the cache keyword, and until kvbench's engine followed, every method ran as FullKV while
its results were stored under its own name. The engine now refuses such runs (``CompressionInactiveError``), but jobs
stored before that still look like results. ``uncompressed_reason`` finds them from what their records measured;
``store verify`` reports them and the report skips them (``--include-uncompressed`` keeps them).

A job is judged only when its method is not ``fullkv`` and its budget is not ``full``. Its records show no compression
when

* a record holds the engine's measurements empty (``layer_entries`` ``[]`` or ``resident_kv_bytes`` 0, what the
  runner wrote when no session saw a prefill): kvbench's cache layer never attached, whatever the method (POD's window
  and Brutal Offload's host copies act through it too). A record without these fields (an older format) shows nothing;
* or a record whose prompt is longer than the budget shows nothing the method must show there. What that is comes
  from the method itself (``Method.expected_compression``, the rule the engine enforces): "prefill" methods must keep
  fewer entries than the prompt after prefill (some layer's ``layer_entries`` below ``prompt_tokens``); "decode"
  methods (D2O's official code evicts from the first decode step) and "attention" methods (OmniKV, Quest and InfLLM
  keep the whole prompt resident) must attend to fewer entries than the prompt (``attended_tokens_mean``); "none"
  (POD, Brutal Offload: the budget is unused; KVMerger's ratio budgets with the paper's fixed theta) shows nothing to
  check.

One such record is enough, as it is for the engine now: a job killed under the rename and resumed after the fix, or
rerun with a larger ``limit``, holds the records its uncompressed run wrote beside new ones.
"""

from __future__ import annotations

from typing import Any

from kvbench.budget import Budget

#: what the engine requires of a prompt longer than the budget, by ``Method.expected_compression``'s answer
ENTRIES_AFTER_PREFILL, ATTENDED_AT_DECODE = ("prefill",), ("decode", "attention")


def uncompressed_reason(meta: dict[str, Any], records: list[dict[str, Any]]) -> str | None:
    """Why the job of ``meta`` (its meta.json) and ``records`` (its samples.jsonl) ran uncompressed, or None when it
    compressed, keeps everything by definition, or its records show nothing either way."""
    method_cfg = meta.get("method") or {}
    budget = _budget(meta)
    if not records or method_cfg.get("name") in (None, "fullkv") or budget is None or budget.is_full:
        return None
    where = f"{method_cfg['name']} at budget {(meta.get('budget') or {}).get('label') or budget.label()}"
    version = f"transformers {(meta.get('versions') or {}).get('transformers') or 'version unknown'}"
    unmeasured = [r for r in records if _unmeasured(r)]
    if unmeasured:
        return (f"{where}: {len(unmeasured)} of {len(records)} record(s) have no cache measurements (empty "
                f"layer_entries or 0 resident KV bytes, e.g. {unmeasured[0].get('id')!s}): kvbench's cache layer never "
                f"attached and FullKV ran under the method's name ({version})")
    expected = _expected_compression(method_cfg, budget, meta)
    checked = [(r, kind) for r in records if (kind := expected(r)) in ENTRIES_AFTER_PREFILL + ATTENDED_AT_DECODE]
    uncompressed = [(r, kind) for r, kind in checked if not _shows_compression(r, kind)]
    if not uncompressed:
        return None
    shown, kind = uncompressed[0]
    what = ("kept every prompt token in every layer" if kind in ENTRIES_AFTER_PREFILL
            else "attended to the whole prompt or more")
    return (f"{where} {what} in {len(uncompressed)} of {len(checked)} sample(s) longer than the budget (e.g. "
            f"{shown.get('id')!s}: {shown.get('prompt_tokens')} prompt tokens): it ran uncompressed ({version})")


def _unmeasured(record: dict[str, Any]) -> bool:
    """The runner's defaults for a sample no session measured (``SessionStats`` never saw a prefill)."""
    return record.get("layer_entries") == [] or record.get("resident_kv_bytes") == 0


def _budget(meta: dict[str, Any]) -> Budget | None:
    budget = meta.get("budget") or {}
    if budget.get("kind") not in ("tokens", "ratio", "full") or not isinstance(budget.get("value"), (int, float)):
        return None  # no typed budget recorded: nothing to compare the records with
    return Budget(budget["kind"], budget["value"])


def _expected_compression(method_cfg: dict[str, Any], budget: Budget, meta: dict[str, Any]):
    """``record -> "prefill" | "decode" | "attention" | "none"``: the method's own answer for that record's prompt.

    The method is rebuilt from meta.json when it can be; otherwise its class's ``compression`` decides (a POD block
    map is stored as ``name#sha256``, not a path, and a run's fields may predate the method's current ones), and a
    method kvbench no longer has is held to the general rule, "prefill"."""
    from kvbench.methods import METHODS, build_method

    try:
        method = build_method(method_cfg, budget)
    except Exception:  # any failure to rebuild falls back to the class: the stored run is what is judged here
        try:
            kind = METHODS.get_class(method_cfg["name"]).compression
        except Exception:
            kind = "prefill"
        return lambda record: kind if _longer_than_budget(record, budget) else "none"
    layers = (meta.get("model") or {}).get("layers")

    def expected(record: dict[str, Any]) -> str:
        prompt = _prompt_tokens(record)
        if prompt is None:
            return "none"
        return method.expected_compression(budget, prompt, layers or len(record.get("layer_entries") or []))

    return expected


def _prompt_tokens(record: dict[str, Any]) -> int | None:
    prompt = record.get("prompt_tokens")
    return prompt if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt > 0 else None


def _longer_than_budget(record: dict[str, Any], budget: Budget) -> bool:
    prompt = _prompt_tokens(record)
    return prompt is not None and budget.tokens_for(prompt) < prompt


def _shows_compression(record: dict[str, Any], kind: str) -> bool:
    """Whether ``record`` shows what a ``kind`` method must show on a prompt longer than the budget. A record without
    the measurement (no ``layer_entries`` field; no decode step, so ``attended_tokens_mean`` 0) shows nothing against
    it."""
    prompt = _prompt_tokens(record)
    if kind in ENTRIES_AFTER_PREFILL:
        entries = record.get("layer_entries")
        return not entries or min(entries) < prompt
    return (record.get("attended_tokens_mean") or 0) < prompt
