"""What a chain of killed-and-resumed training runs fed its model, read from the runs' own logs.

A trainer appends one JSON line per event to its log: ``{"restored": step, "source": path or
null, "incarnation": k}`` when it starts (``departed``: ``[[path, step], ...]``, the states of
ranks that did not come back, restored by this one), ``{"step": s, "records": [...]}`` per batch
trained, ``{"saved": s}`` per checkpoint saved to its own file. Steps go on across runs (a
resumed run counts from the step it restored). One log and one checkpoint file per rank.

The model a job ends with saw the batches of its last incarnation's runs, and before those, for
each checkpoint state restored, the batches of the run that saved it up to that state's step,
and so on back to runs that started from no checkpoint (:func:`timeline`). Against that timeline
a resume is exact when every record is in it exactly once; records trained by a run past the
checkpoint the next incarnation restored are not in it (the model that saw them was thrown
away), and must be trained again.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass
class Run:
    file: str  # the checkpoint file it saves to
    incarnation: int
    restored: int  # the step it resumed from (0 without a checkpoint)
    source: Optional[str]  # the checkpoint file it restored, None: none
    departed: list[tuple[str, int]] = field(default_factory=list)
    batches: list[tuple[int, list[str]]] = field(default_factory=list)
    saves: list[int] = field(default_factory=list)


def read_runs(log: Path, ckpt: str) -> list[Run]:
    """The runs of one rank's log (whose checkpoint file is ``ckpt``), in order; without an
    ``incarnation`` in the log, runs count as incarnations 0, 1, ... (a killed run's last line
    may be cut: skipped)."""
    runs: list[Run] = []
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            entry: dict[str, Any] = json.loads(line)
        except ValueError:
            continue
        if "restored" in entry:
            runs.append(Run(ckpt, int(entry.get("incarnation", len(runs))), int(entry["restored"]),
                            entry.get("source"), [(f, int(s)) for f, s in entry.get("departed", [])]))
        elif "records" in entry:
            runs[-1].batches.append((int(entry["step"]), list(entry["records"])))
        elif "saved" in entry:
            runs[-1].saves.append(int(entry["saved"]))
    return runs


def timeline(runs: list[Run]) -> Counter[str]:
    """Every record the final model was trained on, with how often (see the module docstring):
    ``runs`` of every rank and incarnation."""
    last = max(r.incarnation for r in runs)
    seen: Counter[str] = Counter()
    todo: list[tuple[Run, Optional[int]]] = [(r, None) for r in runs if r.incarnation == last]
    while todo:
        run, upto = todo.pop()
        seen.update(r for step, records in run.batches if upto is None or step <= upto for r in records)
        for source, step in ([(run.source, run.restored)] if run.source else []) + run.departed:
            savers = [s for s in runs
                      if s.file == source and s.incarnation < run.incarnation and step in s.saves]
            assert savers, f"a run restored {source} at step {step}, which no earlier run saved"
            todo.append((max(savers, key=lambda s: s.incarnation), step))
    return seen


def exact(runs: list[Run], expected: Counter[str]) -> None:
    """The final model saw every expected record exactly once: none lost, none twice."""
    seen = timeline(runs)
    lost = set(expected) - set(seen)
    twice = sorted(r for r, n in seen.items() if n > expected.get(r, 0))
    stray = set(seen) - set(expected)
    assert not lost and not twice and not stray, (
        f"{len(lost)} record(s) lost (e.g. {sorted(lost)[:3]}), {len(twice)} seen twice "
        f"(e.g. {twice[:3]}), {len(stray)} not expected (e.g. {sorted(stray)[:3]})")
