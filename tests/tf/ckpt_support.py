"""Helpers for the checkpoint-resume tests of the TensorFlow shim: numbered files, one training
process of ``ckpt_worker.py`` to its end or its own kill, and the SQL checks of the queue."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from tf_support import ENV, HERE

from wq_sql.store.engine import resolve_url

LINES_PER_FILE = 10
CKPT_WORKER = HERE / "ckpt_worker.py"


def write_numbered_files(directory: Path, n_files: int) -> list[str]:
    """Files whose lines are the record numbers 0 .. n_files * LINES_PER_FILE - 1."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n_files):
        path = directory / f"part-{i:03d}.txt"
        path.write_text("".join(f"{i * LINES_PER_FILE + j}\n" for j in range(LINES_PER_FILE)))
        paths.append(str(path))
    return paths


def train(job: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """Run one training process; returns its report, or ``{"killed": True}`` if it SIGKILLed
    itself as asked."""
    job = {**job, **changes}
    p = subprocess.run([sys.executable, str(CKPT_WORKER), json.dumps(job)], capture_output=True, text=True,
                       timeout=150, env=ENV)
    if job.get("kill_at") is not None:
        assert p.returncode == -signal.SIGKILL, f"expected SIGKILL, got {p.returncode}:\n{p.stderr[-5000:]}"
        return {"killed": True}
    assert p.returncode == 0, f"training failed ({p.returncode}):\n{p.stdout}\n{p.stderr[-5000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def rows(url: str, sql: str, **params: Any) -> list[Any]:
    engine = sa.create_engine(resolve_url(url))
    try:
        with engine.connect() as c:
            return list(c.execute(sa.text(sql), params))
    finally:
        engine.dispose()


def check_queue(url: str, queue: str, n_items: int) -> list[Any]:
    """Every item done, each with one 'done' event (stamped with a checkpoint step) since its last
    requeue, the counters agree; returns the queue's wq_checkpoints rows."""
    states = rows(url, "SELECT state, count(*) FROM wq_audit WHERE queue = :q GROUP BY state", q=queue)
    assert dict((s, int(n)) for s, n in states) == {"done": n_items}
    assert rows(url, "SELECT sum(t.n_done) FROM wq_tallies t JOIN wq_queues q ON q.id = t.queue_id "
                     "WHERE q.name = :q", q=queue)[0][0] == n_items
    dones = rows(url, """
        SELECT h.item_id, count(*) FROM wq_history h
        WHERE h.queue = :q AND h.kind = 'done' AND h.event_id > coalesce(
            (SELECT max(r.event_id) FROM wq_history r WHERE r.item_id = h.item_id AND r.kind = 'requeue'), 0)
        GROUP BY h.item_id""", q=queue)
    assert len(dones) == n_items and all(n == 1 for _, n in dones)
    assert all(d.startswith("checkpoint step ") for (d,) in rows(
        url, "SELECT detail FROM wq_history WHERE queue = :q AND kind = 'done'", q=queue))
    return rows(url, "SELECT c.action, c.step, c.items, c.ambiguous FROM wq_checkpoints c "
                     "JOIN wq_queues q ON q.id = c.queue_id WHERE q.name = :q ORDER BY c.id", q=queue)


def base_job(url: str, directory: Path, mode: str, n_files: int) -> dict[str, Any]:
    files = write_numbered_files(directory / "data", n_files)
    return {"mode": mode, "queue": mode, "url": url, "files": files,
            "n_records": n_files * LINES_PER_FILE, "ckpt_dir": str(directory / "ckpt"), "batch": 4,
            "save_every": 5, "pause": 0.0, "restore": "latest"}
