"""Helpers for the TensorFlow shim's tests (a plain module: ``tests/tf`` has no ``__init__.py``,
and a second ``conftest.py`` would clash with the root one under pytest's default import mode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORKER = HERE / "tf_worker.py"
# Child processes: this checkout importable, TensorFlow's C++ logging quiet.
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}


def write_text_files(directory: Path, sizes: list[int]) -> tuple[list[str], list[str]]:
    """One file per size, with that many distinct real lines (some non-ASCII, the last file
    without a final newline); returns the paths and every line."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, lines = [], []
    for i, n in enumerate(sizes):
        mine = [f"file {i:03d} line {j:04d}: {'née café' if j % 5 == 0 else 'plain'} {i * 1000 + j}"
                for j in range(n)]
        path = directory / f"part-{i:03d}.txt"
        text = "\n".join(mine) + ("" if i == len(sizes) - 1 else "\n") if mine else ""
        path.write_text(text, encoding="utf-8")
        paths.append(str(path))
        lines.extend(mine)
    return paths, lines


def states_of(url: str, queue: str, worker: str) -> dict[str, int]:
    """How many items of ``queue`` are in each state with ``worker`` as their holder."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as c:
            rows = c.execute(sa.text("SELECT state, count(*) FROM wq_audit WHERE queue = :q AND worker = :w "
                                     "GROUP BY state"), {"q": queue, "w": worker}).all()
    finally:
        engine.dispose()
    return {state: int(n) for state, n in rows}


def start_worker(job: dict[str, Any]) -> subprocess.Popen[str]:
    """``tf_worker.py`` with ``job`` (JSON) in a child process."""
    return subprocess.Popen([sys.executable, str(WORKER), json.dumps(job)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def finish_worker(p: subprocess.Popen[str], timeout: float = 180) -> dict[str, Any]:
    """Wait for a worker; its last stdout line is its JSON report."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"worker timed out:\n{out}\n{err[-5000:]}") from None
    assert p.returncode == 0, f"worker failed ({p.returncode}):\n{out}\n{err[-5000:]}"
    return json.loads(out.strip().splitlines()[-1])
