"""Copy the papers' tables (tidy CSVs extracted from the paper texts) into ``results/paper/`` with provenance.

    python scripts/import_paper_tables.py --source ../shared/reference/paper_tables --papers ../shared/papers

For every ``<paper>_table<N>_<what>.csv`` of ``--source`` it writes ``results/paper/<same name>.csv``: the same rows
and columns (``value`` exactly as printed; an empty cell is missing in the text), plus

* ``source_text``: the extracted paper text the table was parsed from (``papers/INDEX.md`` names the paper);
* ``caption_line``: the line of that text holding the table's caption (``Table N:`` / ``Table N.``);
* ``page``: the PDF page, left empty: the extracted text carries no page numbers;
* ``notes`` (unchanged): the doubt or inference of that row.

``results/paper/tables.csv`` indexes the tables (paper, table, file, caption, source, number of rows) with the
table-level extraction doubts of ``NOTES.md`` section 1, and ``NOTES.md`` itself is copied beside them. No number is
changed or added here: the rows are copied, never recomputed.
"""

from __future__ import annotations

import argparse
import csv
import re
import shutil
from pathlib import Path

PAPER_FILES = {"D2O": "000", "DynamicKV": "001", "OmniKV": "002", "KVMerger": "003", "POD": "004"}
EXTRA = ("source_text", "caption_line", "page")


def caption_lines(text_path: Path) -> dict[str, tuple[int, str]]:
    """``{"Table 2": (line, caption)}`` for the first ``Table N:`` / ``Table N.`` caption of each table."""
    found: dict[str, tuple[int, str]] = {}
    for number, line in enumerate(text_path.read_text(encoding="utf-8").splitlines(), 1):
        match = re.match(r"\s*Table (\d+)[:.]\s*(.*)", line)
        if match and f"Table {match.group(1)}" not in found:
            caption = re.sub(r"\s+", " ", match.group(2)).strip()
            found[f"Table {match.group(1)}"] = (number, caption[:160])
    return found


def _table_refs(bold: str) -> list[int]:
    """Table numbers named by a bold lead such as ``Table 3 / Table 16``, ``Tables 7–9``, ``Tables 4/5``."""
    refs: list[int] = []
    for first, sep, last in re.findall(r"(\d+)(?:\s*([–/-])\s*(\d+))?", bold):
        if sep in ("–", "-") and last:
            refs += list(range(int(first), int(last) + 1))
        else:
            refs += [int(first)] + ([int(last)] if last else [])
    return refs


def table_doubts(notes_path: Path) -> dict[tuple[str, str], list[str]]:
    """NOTES.md section 1: ``{(paper, "Table N"): [bullet text, ...]}``; bullets naming no table go to
    ``(paper, "")``. Sub-bullets stay with their bullet."""
    section = notes_path.read_text(encoding="utf-8").split("## 1.", 1)[1].split("\n## 2.", 1)[0]
    out: dict[tuple[str, str], list[str]] = {}
    paper, bullets = "", []
    for line in section.splitlines():
        heading = re.match(r"### (\w+)", line)
        if heading:
            paper = heading.group(1)
        elif line.startswith("* "):
            bullets.append((paper, line[2:].strip()))
        elif line.startswith("  *") and bullets:
            bullets[-1] = (bullets[-1][0], bullets[-1][1] + " " + line.strip().lstrip("* ").strip())
    for paper, text in bullets:
        leads = [b for b in re.findall(r"\*\*(.+?)\*\*", text) if b.startswith("Table")]
        refs = sorted({n for b in leads for n in _table_refs(b)})
        clean = text.replace("**", "")
        for ref in refs or [None]:
            out.setdefault((paper, f"Table {ref}" if ref else ""), []).append(clean)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="the folder of tidy table CSVs and NOTES.md")
    parser.add_argument("--papers", type=Path, required=True, help="the folder of the extracted paper texts")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "paper")
    args = parser.parse_args(argv)
    texts = {paper: next(args.papers.glob(f"{prefix}_*.txt")) for paper, prefix in PAPER_FILES.items()}
    captions = {paper: caption_lines(path) for paper, path in texts.items()}
    doubts = table_doubts(args.source / "NOTES.md")
    args.out.mkdir(parents=True, exist_ok=True)
    index = []
    for path in sorted(p for p in args.source.glob("*.csv") if re.fullmatch(r"[a-z0-9]+_table\d+_\w+\.csv", p.name)):
        with path.open(newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
        paper, table = rows[0]["paper"], rows[0]["table"]
        line, caption = captions[paper].get(table, ("", ""))
        with (args.out / path.name).open("w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]) + list(EXTRA), lineterminator="\n")
            writer.writeheader()
            for row in rows:
                writer.writerow({**row, "source_text": texts[paper].name, "caption_line": line, "page": ""})
        index.append({"paper": paper, "table": table, "file": path.name, "caption": caption,
                      "source_text": texts[paper].name, "caption_line": line, "page": "", "rows": len(rows),
                      "table_doubts": " | ".join(doubts.get((paper, table), []))})
    paper_level = [{"paper": p, "table": "", "file": "", "caption": "(paper-level notes)", "source_text":
                    texts[p].name, "caption_line": "", "page": "", "rows": 0, "table_doubts": " | ".join(d)}
                   for (p, t), d in sorted(doubts.items()) if not t]
    order = {p: i for i, p in enumerate(PAPER_FILES)}
    index.sort(key=lambda r: (order[r["paper"]], int(r["table"].split()[1])))
    with (args.out / "tables.csv").open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(index[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(index + paper_level)
    shutil.copyfile(args.source / "NOTES.md", args.out / "NOTES.md")
    print(f"{len(index)} tables, {sum(r['rows'] for r in index)} rows -> {args.out}")


if __name__ == "__main__":
    main()
