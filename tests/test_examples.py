"""The examples run as subprocesses and their printed output is checked, so they cannot rot."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from example_support import assert_left_nothing, tables_in, user_url

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
ENV = {k: v for k, v in os.environ.items() if not k.startswith("WQ_SQL_")} | {"PYTHONPATH": str(ROOT)}


def run_example(name: str, *args: str, cwd: Path) -> str:
    p = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                       timeout=180, env=ENV, cwd=cwd)
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
    url = user_url(db_url)
    check_basic(run_example("basic.py", "--url", url, cwd=tmp_path))
    check_basic(run_example("basic.py", "--url", url, cwd=tmp_path))  # runs again on the same database


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


def run_printed_commands(out: str, cwd: Path) -> list[str]:
    """Run the commands the demo prints at its end, as a user pastes them into a shell where no
    venv is active (the interpreter's folder not on $PATH); returns their output."""
    commands = [line.strip() for line in out.split("Look closer with:\n")[1].splitlines() if line.strip()]
    path = os.pathsep.join(d for d in ENV.get("PATH", "").split(os.pathsep)
                           if d and Path(d).resolve() != Path(sys.executable).parent.resolve())
    outputs = []
    for command in commands:
        p = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60, cwd=cwd,
                           env={**ENV, "PATH": path})
        assert p.returncode == 0, f"{command!r} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
        outputs.append(p.stdout)
    return outputs


def test_long_tail_demo_quick(backend: str, db_url: str, tmp_path: Path) -> None:
    """Default: a SQLite file here; or ``--url``. Either way the commands it prints at the end run
    as printed."""
    args = ["--quick"] if backend == "sqlite" else ["--quick", "--url", user_url(db_url)]
    out = run_example("long_tail_demo.py", *args, cwd=tmp_path)
    check_demo(out)
    assert (tmp_path / "long_tail_demo.db").exists() == (backend == "sqlite")
    outputs = run_printed_commands(out, tmp_path)
    assert len(outputs) == 2, out
    status, report = outputs
    assert "queue 'long_tail_demo'" in status, status
    assert (tmp_path / "long_tail_demo.html").read_text().count('<rect class="bar"') == 48, report
    # A second run replaces the queue (and the SQLite file) and starts over.
    check_demo(run_example("long_tail_demo.py", *args, cwd=tmp_path))


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_long_tail_demo_prints_the_command_of_its_own_python(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``.venv/bin/wq-sql`` after ``make demo``; the interpreter's ``-m wq_sql`` where it has no
    script; an absolute path when the venv is not under the current folder."""
    demo = load_example("long_tail_demo.py")
    bindir = tmp_path / "my project" / ".venv" / "bin"
    bindir.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    monkeypatch.chdir(tmp_path / "my project")
    assert demo._cli() == ".venv/bin/python -m wq_sql"
    (bindir / "wq-sql").touch()
    assert demo._cli() == ".venv/bin/wq-sql"
    monkeypatch.chdir(bindir)
    assert demo._cli() == "./wq-sql"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert demo._cli() == shlex.quote(str(bindir / "wq-sql"))
    assert demo._cli().startswith("'/")  # quoted: the path has a space


def test_sliced_sources(backend: str, db_url: str, tmp_path: Path) -> None:
    """Default: a throwaway SQLite file; or ``--url``, where it leaves no table and no queue."""
    args = [] if backend == "sqlite" else ["--url", user_url(db_url)]
    tables_before = tables_in(db_url) if backend == "postgresql" else []
    out = run_example("sliced_sources.py", *args, cwd=tmp_path)
    assert "every row and line exactly once: True" in out, out
    reads = {line.split()[0]: int(line.split()[2]) for line in out.splitlines() if " read " in line}
    assert sorted(reads) == ["w0", "w1", "w2"] and sum(reads.values()) == 25_000, out
    assert min(reads["w0"], reads["w1"]) > reads["w2"], out  # the straggler read less
    assert list(tmp_path.iterdir()) == []
    if backend == "postgresql":
        assert_left_nothing(db_url, tables_before)
