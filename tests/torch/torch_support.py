"""Helpers for the PyTorch shim's tests (a plain module: ``tests/torch`` has no ``__init__.py``, as
``tests/tf``). Ranks run ``torch_rank.py`` in their own processes, with the environment torchrun
gives them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RANK = HERE / "torch_rank.py"
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("WQ_SQL_", "RANK", "WORLD_SIZE",
                                                                 "TORCHELASTIC", "MASTER_"))}
ENV["PYTHONPATH"] = str(ROOT)


def write_files(directory: Path, n_files: int, n_lines: int) -> tuple[list[str], list[str]]:
    """``n_files`` small text files of ``n_lines`` distinct lines each; the paths and every line."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, lines = [], []
    for i in range(n_files):
        mine = [f"f{i:04d}-{j:03d}" for j in range(n_lines)]
        path = directory / f"part-{i:04d}.txt"
        path.write_text("\n".join(mine) + "\n")
        paths.append(str(path))
        lines.extend(mine)
    return paths, lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_rank(job: dict[str, Any], rank: int, world: int, port: int, run_id: str = "test",
               read_seconds: float = 0.0, restart: int | None = None,
               script: Path = RANK) -> subprocess.Popen[str]:
    """One rank in its own process group (so that a test can kill it with its DataLoader workers);
    its DataLoader workers sleep ``read_seconds`` per item read (a slow input pipeline).
    ``restart``: torchrun's ``TORCHELASTIC_RESTART_COUNT`` (unset by default). ``script``: what
    the rank runs (``torch_rank.py``; ``torch_ckpt_trainer.py`` with ``per_rank``)."""
    env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id,
           "TEST_READ_SECONDS": str(read_seconds)}
    if restart is not None:
        env["TORCHELASTIC_RESTART_COUNT"] = str(restart)
    return subprocess.Popen([sys.executable, str(script), json.dumps(job)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def finish(p: subprocess.Popen[str], timeout: float = 240) -> dict[str, Any]:
    """Wait for a rank; its last stdout line is its JSON report."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, err = p.communicate()
        raise AssertionError(f"rank timed out:\n{out}\n{err[-5000:]}") from None
    assert p.returncode == 0, f"rank failed ({p.returncode}):\n{out}\n{err[-5000:]}"
    return json.loads(out.strip().splitlines()[-1])


def kill_ranks_when(ranks: list[subprocess.Popen[str]], ready: Callable[[], bool], what: str,
                    timeout: float = 120) -> None:
    """Once ``ready()`` (polled; no rank may end before), SIGKILL every rank's process group and
    reap it. ``what`` names the state waited for, in the failure message."""
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert time.monotonic() < deadline, f"the ranks did not get {what}"
            for p in ranks:
                assert p.poll() is None, p.communicate()[1][-3000:]
            time.sleep(0.05)
    finally:  # a failed wait kills them too: no rank outlives the test
        for p in ranks:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in ranks:
            p.wait()
    time.sleep(0.1)


def read_log(path: Path) -> list[dict[str, Any]]:
    """The batches a rank trained on, one JSON line each (``epoch``, ``records``, ``workers``)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # the last line of a killed rank may be cut
            pass
    return out


def per_epoch(batches: list[dict[str, Any]]) -> dict[int, Counter[str]]:
    counts: dict[int, Counter[str]] = {}
    for b in batches:
        counts.setdefault(b["epoch"], Counter()).update(b["records"])
    return counts


def sql(url: str, query: str, **params: Any) -> list[Any]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as c:
            return list(c.execute(sa.text(query), params).all())
    finally:
        engine.dispose()


def audit_exactly_once(url: str, queue: str, items_per_epoch: int, epochs: int) -> None:
    """The SQL audit: every item of every epoch done, each with exactly one 'done' event."""
    rows = sql(url, "SELECT epoch, state, count(*) FROM wq_audit WHERE queue = :q GROUP BY epoch, state",
               q=queue)
    assert sorted(tuple(r) for r in rows) == [(e, "done", items_per_epoch) for e in range(epochs)], rows
    twice = sql(url, "SELECT epoch, seq, count(*) FROM wq_history WHERE queue = :q AND kind = 'done' "
                     "GROUP BY epoch, seq HAVING count(*) <> 1", q=queue)
    assert twice == [], twice


@pytest.fixture(autouse=True)
def close_datasets(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close every dataset and sampler a test made (its queue objects), before its database goes."""
    if "db_url" in request.fixturenames:
        request.getfixturevalue("db_url")  # set up first, so torn down after this fixture
    from wq_sql.torch.dataset import QueuePasses  # torch only where a test asks for it

    made: list[QueuePasses] = []
    init = QueuePasses.__init__

    def remember(self: QueuePasses, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(QueuePasses, "__init__", remember)
    yield
    for passes in made:
        passes.close()
