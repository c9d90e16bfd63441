"""The one table of figures: BENCHMARKS.md's summary and the README's performance table are what
``bench/results.json`` renders, so a figure is written once and agrees wherever it is shown, and
the headline run's figures land in the rows they measure."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from backends import ROOT


def _summary():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("wq_bench_summary", ROOT / "bench" / "summary.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["wq_bench_summary"] = module
    spec.loader.exec_module(module)
    return module


summary = _summary()


def test_the_pages_show_what_results_json_holds() -> None:
    assert summary.differs(summary.load()) == [], "run .venv/bin/python bench/summary.py"


def test_every_headline_target_has_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``make bench`` measures is exactly the set of rows marked ``headline``: a target
    renamed in one place and not the other would stop updating silently."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # headline.py imports _common
    spec = importlib.util.spec_from_file_location("wq_bench_headline", ROOT / "bench" / "headline.py")
    assert spec is not None and spec.loader is not None
    h = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "wq_bench_headline", h)  # its dataclasses look their module up
    spec.loader.exec_module(h)
    backends = ("sqlite", "postgresql")
    made = ({h._claim_target(b, n) for b in backends for n in (1, 32)} | {h._tail_target(b) for b in backends}
            | {h._tf_target(b, lines) for b in backends for lines in (100, 1000)} | {h.ROLLOVER_TARGET})
    assert {r["headline"] for r in summary.load() if r.get("headline")} == made


@dataclass
class Measured:
    target: str
    measured: str
    verdict: str


def test_a_headline_run_updates_only_the_rows_it_measured(tmp_path: Path) -> None:
    rows = summary.load()
    before = [dict(r) for r in rows]
    roll = next(r for r in rows if r.get("headline", "").startswith("SQLite, 8 processes"))
    n = summary.record(rows, [
        Measured(roll["headline"], "31 ms (median claim 1.8 ms; ...)", "met"),
        Measured("Long tail, Postgres: 8 workers, one 4x slow, default settings, makespan / ideal", "-",
                 "not measured: Postgres unreachable"),
        Measured("a target nobody has", "1x", "met"),
    ], "abc1234")
    assert n == 1
    assert (roll["latest"], roll["commit"], roll["verdict"]) == ("31 ms", "abc1234", "met")
    changed = [i for i, (r, b) in enumerate(zip(rows, before)) if r != b]
    assert changed == [rows.index(roll)]


def test_a_target_closed_by_decision_keeps_its_verdict() -> None:
    rows = summary.load()
    closed = next(r for r in rows if r.get("closed") and r.get("headline"))
    summary.record(rows, [Measured(closed["headline"], "0.5x (...)", "MISSED")], "abc1234")
    assert closed["latest"] == "0.5x" and closed["verdict"].startswith("closed by decision")


def test_a_page_without_its_markers_is_refused() -> None:
    with pytest.raises(SystemExit, match="summary:begin"):
        summary.replaced("no markers here", "summary", "| x |")
