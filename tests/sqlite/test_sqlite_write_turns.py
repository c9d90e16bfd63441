"""What a SQLite write transaction does while it holds the write lock (and its turn of the
machine's writers' queue, every other writer waiting): no scan of the items, no statement
compiled.

SQLite plans a row-value ``(id, token) IN (...)`` of two or more pairs, on its own, as a scan of
every item of the queue (all epochs): a worker's ``close()``, giving back what it claimed ahead,
held the lock 100-140 ms on a queue of 1,000,000 items. And SQLAlchemy building and compiling
``close()``'s statements for the first time in a process held it 4-21 ms (8 workers on 2 cores,
load 1.3-2.4): a roll-over's workers all waited behind each worker that left. Postgres has row
locks, and its plans depend on table statistics: this file checks SQLite only.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.sql import compiler

import wq_sql.store.db
from wq_sql import WorkQueue

OPTS: dict[str, Any] = dict(auto_complete=False, lease_ahead=4, claim_ahead=False, lease_seconds=300,
                            heartbeat_seconds=60, max_attempts=5)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'q.db'}"


def test_ending_statements_search_the_items_by_key(url: str) -> None:
    ran: list[str] = []  # every statement run on the worker's connections, values filled in

    def trace(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        dbapi_conn.set_trace_callback(ran.append)

    with WorkQueue([f"w{i}" for i in range(500)], num_epochs=2, worker="a", url=url, **OPTS) as wq, \
            WorkQueue.attach(worker="b", url=url, **OPTS) as other:
        handed = other.take()
        sa.event.listen(wq.engine, "checkout", trace)
        a, b, c, d, e = (wq.take() for _ in range(5))
        wq.complete(a)
        wq.release(b)
        wq.fail(c, "broken")
        assert not wq.cover([d], step=1)
        assert not wq.adopt_handed({other.worker_id: [handed]})
        other.hand_off([handed])
        assert wq.still_held([e]) == [e]
        # close(): gives back e, the items claimed ahead and the adopted one, and leaves
    touching = [s for s in ran if "wq_items" in s and s.lstrip().split()[0].upper() in ("UPDATE", "SELECT",
                                                                                          "DELETE", "WITH")]
    gave_back = [s for s in touching if "SETstate='pending',token=NULL" in s.replace(" ", "")]
    assert len(gave_back) == 2, touching  # release(b), then close()'s

    scans = []
    with sqlite3.connect(url.removeprefix("sqlite:///")) as check:
        for statement in touching:
            plan = check.execute("EXPLAIN QUERY PLAN " + statement).fetchall()
            scans += [(statement, row[-1]) for row in plan if row[-1].startswith("SCAN wq_items")]
    assert not scans, scans


@pytest.fixture
def compiled_in_turn(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The statements SQLAlchemy compiles while a write transaction holds its turn."""
    held: list[bool] = []
    seen: list[str] = []
    enter, leave = wq_sql.store.db._Held.__enter__, wq_sql.store.db._Held.__exit__
    init = compiler.SQLCompiler.__init__

    def counting_init(self: Any, dialect: Any, statement: Any, *args: Any, **kwargs: Any) -> None:
        if held:
            seen.append(type(statement).__name__)  # (str() would compile it again)
        init(self, dialect, statement, *args, **kwargs)

    def held_enter(self: Any) -> None:
        enter(self)
        held.append(True)

    def held_exit(self: Any, *exc: Any) -> Any:
        held.pop()
        return leave(self, *exc)

    monkeypatch.setattr(compiler.SQLCompiler, "__init__", counting_init)
    monkeypatch.setattr(wq_sql.store.db._Held, "__enter__", held_enter)
    monkeypatch.setattr(wq_sql.store.db._Held, "__exit__", held_exit)
    yield seen


@pytest.mark.parametrize("auto_complete", [True, False])
def test_close_compiles_no_statement_holding_its_turn(url: str, compiled_in_turn: list[str],
                                                      auto_complete: bool) -> None:
    WorkQueue([f"w{i}" for i in range(100)], worker="maker", url=url, max_attempts=5).close()
    wq = WorkQueue.attach(worker="a", url=url, **{**OPTS, "auto_complete": auto_complete})
    for _ in range(6):  # acknowledgements pending, items handed out and claimed ahead
        wq.take()
    assert wq.buffered
    compiled_in_turn.clear()
    wq.close()
    assert compiled_in_turn == []
    with sqlite3.connect(url.removeprefix("sqlite:///")) as check:
        states = dict(check.execute("SELECT state, count(*) FROM wq_items GROUP BY state").fetchall())
        closed = check.execute("SELECT heartbeat_at IS NULL FROM wq_workers WHERE name = 'a'").fetchone()
    assert states == ({"done": 6, "pending": 94} if auto_complete else {"pending": 100}), states
    assert closed == (1,)
