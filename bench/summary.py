"""The one table of figures: ``bench/results.json`` rendered into BENCHMARKS.md's summary and the
README's performance table, between their markers, so that each figure is written once and every
page that shows it agrees.

    .venv/bin/python bench/summary.py            # rewrite both tables from results.json
    .venv/bin/python bench/summary.py --check    # exit 1 if a page differs from results.json

``results.json`` holds one row per target: its goal, the latest figure, the commit it was
measured at, the verdict and the command. ``make bench`` (``bench/headline.py``) updates the rows
it measures (those with a ``headline`` key: the target as headline.py names it) and rewrites the
tables; rows measured by the long scripts are updated by hand from their output, with the commit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results.json"
PAGES = {ROOT / "BENCHMARKS.md": "summary", ROOT / "README.md": "performance"}


def load(path: Path = RESULTS) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))["rows"]
    return rows


def save(rows: list[dict[str, Any]], path: Path = RESULTS) -> None:
    path.write_text(json.dumps({"rows": rows}, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def latest(row: dict[str, Any]) -> str:
    return f"{row['latest']} ({row['commit']})" if row.get("commit") else row["latest"]


def render(rows: list[dict[str, Any]], which: str) -> str:
    """The markdown table for ``which``: ``summary`` (every row) or ``performance`` (the rows
    marked ``readme``, without the command)."""
    if which == "summary":
        lines = ["| target | goal | latest (commit) | verdict | command (`bench/`) |", "|---|---|---|---|---|"]
        lines += [f"| {r['target']} | {r['goal']} | {latest(r)} | {r['verdict']} | {r['command']} |" for r in rows]
    else:
        lines = ["| what | goal | latest | verdict |", "|---|---|---|---|"]
        lines += [f"| {r['target']} | {r['goal']} | {r['latest']} | {r['verdict']} |" for r in rows if r.get("readme")]
    return "\n".join(lines)


def replaced(text: str, marker: str, table: str) -> str:
    """``text`` with what lies between ``<!-- {marker}:begin -->`` and ``<!-- {marker}:end -->``
    replaced by ``table``."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise SystemExit(f"expected one {begin} and one {end}")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{table}\n{end}{tail}"


def record(rows: list[dict[str, Any]], measured: list[Any], commit: str) -> int:
    """Put headline.py's measured rows (``target``, ``measured``, ``verdict``) into ``rows``;
    returns how many changed. A row not measured keeps its last figure."""
    by = {r["headline"]: r for r in rows if r.get("headline")}
    n = 0
    for m in measured:
        row = by.get(m.target)
        if row is None or not m.verdict.startswith(("met", "MISSED")):
            continue
        row["latest"] = m.measured.split(" (")[0]
        row["commit"] = commit
        if not row.get("closed"):  # a target closed by decision keeps its verdict, not its figure
            row["verdict"] = "met" if m.verdict.startswith("met") else "missed"
        n += 1
    return n


def write(rows: list[dict[str, Any]]) -> None:
    for page, marker in PAGES.items():
        page.write_text(replaced(page.read_text(encoding="utf-8"), marker, render(rows, marker)), encoding="utf-8")


def differs(rows: list[dict[str, Any]]) -> list[str]:
    """The pages whose table is not what ``rows`` render."""
    out = []
    for page, marker in PAGES.items():
        text = page.read_text(encoding="utf-8")
        if replaced(text, marker, render(rows, marker)) != text:
            out.append(str(page.relative_to(ROOT)))
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only say whether the pages agree with results.json")
    a = ap.parse_args(argv)
    rows = load()
    if a.check:
        bad = differs(rows)
        if bad:
            print(f"out of date with bench/results.json: {', '.join(bad)} (run bench/summary.py)")
            return 1
        return 0
    write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
