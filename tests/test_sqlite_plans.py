"""SQLite plans of the statements that end deliveries: each finds its rows by primary key.

SQLite plans a row-value ``(id, token) IN (...)`` of two or more pairs, on its own, as a scan of
every item of the queue (all epochs), with the write lock held: a worker's ``close()`` (giving
back the items it claimed ahead) held it 100-140 ms on a queue of 1,000,000 items, every other
writer of the machine waiting. Postgres turns the same list into probes of the primary key; its
plans depend on table statistics, so this file checks SQLite only.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from wq_sql import WorkQueue


def test_ending_statements_search_the_items_by_key(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    url = f"sqlite:///{db}"
    ran: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if not many and "wq_items" in statement and not statement.lstrip().upper().startswith("INSERT"):
            ran.append((statement, parameters))

    opts: dict[str, Any] = dict(url=url, auto_complete=False, lease_ahead=4, claim_ahead=False,
                                lease_seconds=300, heartbeat_seconds=60, max_attempts=5)
    with WorkQueue([f"w{i}" for i in range(500)], num_epochs=2, worker="a", **opts) as wq, \
            WorkQueue.attach(worker="b", **opts) as other:
        handed = other.take()
        sa.event.listen(wq.engine, "before_cursor_execute", record)
        a, b, c, d, e = (wq.take() for _ in range(5))
        wq.complete(a)
        wq.release(b)
        wq.fail(c, "broken")
        assert not wq.cover([d], step=1)
        assert not wq.adopt_handed({other.worker_id: [handed]})
        other.hand_off([handed])
        assert wq.still_held([e]) == [e]
        # close(): gives back e, the items claimed ahead and the adopted one, and leaves
    statements = {s for s, _ in ran}
    assert any(s.lstrip().upper().startswith("UPDATE") for s in statements), statements

    scans = []
    with sqlite3.connect(db) as check:
        for statement, parameters in ran:
            plan = check.execute("EXPLAIN QUERY PLAN " + statement, parameters).fetchall()
            scans += [(statement, row[-1]) for row in plan if row[-1].startswith("SCAN wq_items")]
    assert not scans, scans
