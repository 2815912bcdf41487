"""kvbench.report.question: runs of the two question placements paired on everything else, each against the FullKV
of its own placement."""

import pandas as pd

from kvbench.report.question import markdown, pairs, question_summary, question_table


def _run(method: str, budget: str, question: str, score: float, kv: float, task_cfg: dict | None = None,
         label: str | None = None) -> dict:
    return {"model": "m", "task": "passkey", "method": method, "method_label": label or method, "budget": budget,
            "score": score, "n_samples": 4, "question": question,
            "task_cfg": task_cfg or {"task": "passkey", "context_lengths": [4096], "fields": {"x": 1}},
            "scores": {"resident_kv_bytes_mean": kv}}


def _frame(*rows: dict) -> pd.DataFrame:
    return pd.DataFrame(list(rows))


def test_pairs_each_placement_against_its_own_fullkv():
    runs = _frame(_run("fullkv", "full", "with_context", 80.0, 2**20), _run("fullkv", "full", "after_compression",
                                                                            40.0, 2**20),
                  _run("snapkv", "0.25", "with_context", 40.0, 2**18), _run("snapkv", "0.25", "after_compression",
                                                                            20.0, 2**18),
                  _run("knorm", "0.25", "with_context", 20.0, 2**18))
    table = question_table(runs)
    snap = table[table["method"] == "snapkv"].iloc[0]
    assert (snap["score with ctx"], snap["score after compr."], snap["Δ score"]) == ("40.00", "20.00", "-20.00")
    assert (snap["% FullKV with ctx"], snap["% FullKV after compr."]) == ("50.0", "50.0")  # each vs its own FullKV
    assert snap["KV MiB with ctx"] == "0.250" and snap["n"] == "4 / 4"
    knorm = table[table["method"] == "knorm"].iloc[0]
    assert knorm["score after compr."] == "—" and knorm["n"] == "4 / —"
    assert list(table["method"])[0] == "fullkv"
    summary = question_summary(runs)
    assert list(summary["method"]) == ["knorm", "snapkv"]
    assert summary.set_index("method").loc["snapkv", "Δ points"] == "+0.0"
    assert summary.set_index("method").loc["knorm", "tasks"] == "0"  # one placement only: no mean
    assert markdown(table).count("\n") == len(table) + 2


def test_runs_of_other_task_protocols_or_configurations_are_not_paired():
    other = {"task": "passkey", "context_lengths": [2048]}
    runs = _frame(_run("snapkv", "0.25", "with_context", 40.0, 1.0),
                  _run("snapkv", "0.25", "after_compression", 20.0, 1.0, task_cfg=other),
                  _run("snapkv", "0.25", "after_compression", 10.0, 1.0, label="snapkv[window=64]"))
    cells = pairs(runs)
    assert len(cells) == 3 and all(len(c["runs"]) == 1 for c in cells)
    assert pairs(runs, budgets=["0.5"]) == [] and len(pairs(runs, methods=["knorm"])) == 0


def test_load_runs_reads_the_question_and_keeps_the_placements_apart(tmp_path):
    """The key names question=after_compression (with_context, the default, is left out of it): ``load_runs`` gives
    every run its ``question``, and an after_compression run its own protocol group (its own FullKV)."""
    import json

    import yaml

    from kvbench.report.runs import groups
    from kvbench.report.store import load_runs

    def write(method: str, budget: str, digest: str, question: str | None) -> None:
        job = tmp_path / "runs" / "m" / "passkey" / method / budget / digest
        job.mkdir(parents=True)
        key = {"method": {"name": method}, "budget": budget, "task": {"task": "passkey", "context_lengths": [4096]},
               **({"question": question} if question else {})}
        (job / "config.yaml").write_text(yaml.safe_dump({"key": key}))
        (job / "scores.json").write_text(json.dumps({"model": "m", "task": "passkey", "method": method,
                                                     "budget": budget, "score": 50.0, "n_samples": 1}))
        (job / "samples.jsonl").write_text("")

    write("fullkv", "full", "aaaaaaaaaaaa", None)
    write("fullkv", "full", "bbbbbbbbbbbb", "after_compression")
    write("snapkv", "0.25", "cccccccccccc", "after_compression")
    runs = load_runs(tmp_path)
    assert sorted(runs["question"]) == ["after_compression", "after_compression", "with_context"]
    assert groups(runs) == [("m", "passkey", ""), ("m", "passkey", "question=after_compression")]
    assert len(question_table(runs)) == 2  # fullkv (both placements) and snapkv (after compression only)
