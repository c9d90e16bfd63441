"""The examples run as subprocesses and their printed output is checked, so they cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WQ_SQL_")}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                       timeout=180, env=env, cwd=cwd)
    assert p.returncode == 0, f"{name} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
    return p.stdout


def check_basic(out: str) -> None:
    assert "took 'a.txt' (epoch 0, seq 0) -> complete: done" in out
    assert "release: back to the queue, no attempt counted" in out
    assert "fail: attempt 2 of 2, now failed" in out
    assert "QueueExhausted: queue 'basic' is exhausted: 3 items done, 1 failed" in out
    audit = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith("  ")
             and line.split()[1:2] and line.split()[1].endswith(".txt")}
    assert {w: row[3] for w, row in audit.items()} == {
        "a.txt": "done", "b.txt": "failed", "c.txt": "done", "d.txt": "done"}
    assert audit["b.txt"][4] == "2" and "bad record at line 3" in " ".join(audit["b.txt"])
    kinds = [line.split()[1] for line in out.split("FROM wq_history")[1].splitlines()[2:] if line.strip()]
    assert kinds.count("claim") == 6 and kinds.count("release") == 1 and kinds.count("fail") == 2
    assert kinds.count("done") == 3


def test_basic_default(tmp_path: Path) -> None:
    check_basic(run_example("basic.py", cwd=tmp_path))
    assert list(tmp_path.iterdir()) == []  # its SQLite file lived in a temporary folder


@pytest.mark.parametrize("backend", ["postgresql"])
def test_basic_on_postgres(db_url: str, tmp_path: Path) -> None:
    check_basic(run_example("basic.py", "--url", db_url, cwd=tmp_path))
    check_basic(run_example("basic.py", "--url", db_url, cwd=tmp_path))  # runs again on the same database


def check_demo(out: str) -> None:
    assert "exactly once: OK" in out, out
    assert "the workers' own logs agree" in out, out
    assert "fast workers took more: yes" in out, out
    totals: dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0].startswith(("fast-", "slow-")) and len(parts) >= 5:
            totals[parts[0]] = int(parts[-2])
    fast = [n for w, n in totals.items() if w.startswith("fast-")]
    slow = [n for w, n in totals.items() if w.startswith("slow-")]
    assert len(fast) == 3 and len(slow) == 1, out  # --quick: 3 fast workers, 1 straggler
    assert sum(totals.values()) == 48, out  # 2 epochs of 24 items
    assert min(fast) > max(slow), out
    for label in ("work queue (measured", "static sharding, works[i::4] (computed)", "ideal:"):
        assert label in out, out


def test_long_tail_demo_quick(tmp_path: Path) -> None:
    out = run_example("long_tail_demo.py", "--quick", cwd=tmp_path)
    check_demo(out)
    assert (tmp_path / "long_tail_demo.db").exists()
    # A second run replaces the file and starts over.
    check_demo(run_example("long_tail_demo.py", "--quick", cwd=tmp_path))


@pytest.mark.parametrize("backend", ["postgresql"])
def test_long_tail_demo_quick_on_postgres(db_url: str, tmp_path: Path) -> None:
    out = run_example("long_tail_demo.py", "--quick", "--url", db_url, cwd=tmp_path)
    check_demo(out)
    assert not (tmp_path / "long_tail_demo.db").exists()


def test_sliced_sources(tmp_path: Path) -> None:
    out = run_example("sliced_sources.py", cwd=tmp_path)
    assert "every row and line exactly once: True" in out, out
    reads = {line.split()[0]: int(line.split()[2]) for line in out.splitlines() if " read " in line}
    assert sorted(reads) == ["w0", "w1", "w2"] and sum(reads.values()) == 25_000, out
    assert min(reads["w0"], reads["w1"]) > reads["w2"], out  # the straggler read less
    assert list(tmp_path.iterdir()) == []
