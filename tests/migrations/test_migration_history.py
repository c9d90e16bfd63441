"""Revision 0005 converts history written by the code of revision 0004 without losing a delivery.

A queue is made, the database taken back to revision 0004, and a history written there as the
old code wrote it (a ``claim`` row when a delivery began, another when it ended: :class:`OldCode`
does each transition's item update and rows, as ``ops`` and ``claim`` did), covering every way a
delivery begins and ends, deliveries still in flight and claims whose end was never recorded.
After ``upgrade head``, ``wq_history`` must show every item's history exactly as before (kind,
worker, time, detail, in event_id order), the stored rows must be one per delivery with its
``claimed_at`` and attempt, and today's code must carry on with that queue: the restarted
identity takes its items back, the others' expire, the history of each item goes on after its
old one, and ``wq-sql audit`` finds every item done exactly once. Downgrade gives back the old
form with the same history. Both backends.
"""

from __future__ import annotations

import datetime as dt
import secrets
from collections.abc import Iterator
from typing import Any, Optional

import pytest
import sqlalchemy as sa
from alembic import command
from sqlalchemy.pool import NullPool

from wq_sql import WorkQueue
from wq_sql.monitor import report
from wq_sql.store import migrate
from wq_sql.store.engine import resolve_url

pytestmark = pytest.mark.parametrize("backend", ["sqlite", "postgresql"])

QUEUE = "old"
MAX_ATTEMPTS = 3
WORKS = [f"w{i:02d}" for i in range(16)]
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


@pytest.fixture
def engine(empty_db_url: str) -> Iterator[sa.Engine]:
    eng = sa.create_engine(resolve_url(empty_db_url), poolclass=NullPool)
    yield eng
    eng.dispose()


def migrate_to(engine: sa.Engine, revision: str, down: bool = False) -> None:
    with engine.begin() as c:
        (command.downgrade if down else command.upgrade)(migrate.alembic_config(c), revision)


def history(engine: sa.Engine) -> dict[int, list[tuple[Any, ...]]]:
    """wq_history per seq (epoch 0): (kind, worker, at, detail) in event_id order."""
    out: dict[int, list[tuple[Any, ...]]] = {}
    with engine.connect() as c:
        for r in c.execute(sa.text("SELECT seq, kind, worker, at, detail FROM wq_history "
                                   "WHERE queue = :q ORDER BY event_id"), {"q": QUEUE}):
            out.setdefault(r.seq, []).append((r.kind, r.worker, r.at, r.detail))
    return out


class OldCode:
    """The transitions of revision 0004's code, as raw SQL: each updates the item row and writes
    its event rows (a claim writes one too), the counters and the clock as that code did."""

    def __init__(self, c: sa.Connection, sqlite: bool) -> None:
        self.c, self.sqlite, self.t = c, sqlite, T0
        self.qid = c.execute(sa.text("SELECT id FROM wq_queues WHERE name = :q"), {"q": QUEUE}).scalar_one()
        self.workers: dict[str, int] = {}

    def now(self) -> Any:
        self.t += dt.timedelta(seconds=1)
        # SQLite keeps text in the format of SQLAlchemy and wq_sql's SQL clock.
        return self.t.replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f") if self.sqlite else self.t

    def x(self, sql: str, **p: Any) -> Any:
        return self.c.execute(sa.text(sql), p)

    def worker(self, name: str) -> int:
        if name not in self.workers:
            # Closed (heartbeat NULL), as a worker that left: today's code may take the name over.
            self.workers[name] = self.x(
                "INSERT INTO wq_workers (queue_id, name, incarnation, host, pid, started_at, heartbeat_at) "
                "VALUES (:q, :n, 'old', 'oldhost', 1, :t, NULL) RETURNING id",
                q=self.qid, n=name, t=self.now()).scalar_one()
        return self.workers[name]

    def item(self, seq: int) -> Any:
        return self.x("SELECT * FROM wq_items WHERE queue_id = :q AND epoch = 0 AND seq = :s",
                      q=self.qid, s=seq).one()

    def event(self, i: Any, kind: str, worker_id: Optional[int], token: Optional[int], at: Any,
              detail: Optional[str] = None) -> None:
        self.x("INSERT INTO wq_events (queue_id, item_id, epoch, seq, kind, worker_id, token, at, detail) "
               "VALUES (:q, :i, 0, :s, :k, :w, :tok, :at, :d)",
               q=self.qid, i=i.id, s=i.seq, k=kind, w=worker_id, tok=token, at=at, d=detail)

    def tally(self, wid: Optional[int], column: str, k: int) -> None:
        if wid is None:
            return
        if not self.x(f"UPDATE wq_tallies SET {column} = {column} + :k WHERE queue_id = :q AND epoch = 0 "
                      "AND worker_id = :w", k=k, q=self.qid, w=wid).rowcount:
            self.x(f"INSERT INTO wq_tallies (queue_id, epoch, worker_id, {column}) VALUES (:q, 0, :w, :k)",
                   q=self.qid, w=wid, k=k)

    def claim(self, seq: int, who: str) -> None:
        w, t, tok = self.worker(who), self.now(), secrets.randbits(62) + 1
        # Leases of the old holders ran out long ago: today's code expires what it finds held.
        self.x("UPDATE wq_items SET state = 'claimed', worker_id = :w, token = :tok, claimed_at = :t, "
               "lease_until = :t, done_at = NULL WHERE queue_id = :q AND epoch = 0 AND seq = :s",
               w=w, tok=tok, t=t, q=self.qid, s=seq)
        self.event(self.item(seq), "claim", w, tok, t)

    def done(self, seq: int, detail: Optional[str] = None) -> None:
        i, t = self.item(seq), self.now()
        self.x("UPDATE wq_items SET state = 'done', done_at = :t, lease_until = NULL WHERE id = :i",
               t=t, i=i.id)
        self.event(i, "done", i.worker_id, i.token, t, detail)
        self.tally(i.worker_id, "n_done", 1)

    def release(self, seq: int) -> None:
        i = self.item(seq)
        self.x("UPDATE wq_items SET state = 'pending', token = NULL, lease_until = NULL WHERE id = :i",
               i=i.id)
        self.event(i, "release", i.worker_id, i.token, self.now())

    def _attempt(self, seq: int, kind: str, why: str, keep: bool = False) -> None:
        i, t = self.item(seq), self.now()
        failed = i.attempts + 1 >= MAX_ATTEMPTS
        state = "failed" if failed else ("claimed" if keep else "pending")
        token = secrets.randbits(62) + 1 if keep and not failed else None
        self.x("UPDATE wq_items SET state = :st, attempts = attempts + 1, token = :tok, last_error = :why, "
               "done_at = :d WHERE id = :i", st=state, tok=token, why=why, d=t if failed else None, i=i.id)
        self.event(i, "fail" if keep and failed else kind, i.worker_id, None if kind != "fail" else i.token,
                   t, "worker died holding it too often" if keep and failed else why)
        if failed:
            self.tally(i.worker_id, "n_failed", 1)

    def fail(self, seq: int) -> None:
        self._attempt(seq, "fail", "ValueError: bad record")

    def expire(self, seq: int) -> None:
        self._attempt(seq, "expire", "lease expired")

    def recover(self, seq: int) -> None:
        self._attempt(seq, "recover", "restarted worker took its items back", keep=True)

    def requeue(self, seq: int) -> None:
        i = self.item(seq)
        self.x("UPDATE wq_items SET state = 'pending', token = NULL, lease_until = NULL, done_at = NULL, "
               "attempts = CASE WHEN state = 'failed' THEN 0 ELSE attempts END WHERE id = :i", i=i.id)
        self.event(i, "requeue", i.worker_id, None, self.now(), f"operator requeued a {i.state} item")
        if i.state in ("done", "failed"):
            self.tally(i.worker_id, "n_done" if i.state == "done" else "n_failed", -1)


# seq -> what the old code did to it (workers a, b, c); what each row must become after 0005.
SCRIPTS: dict[int, list[tuple[str, ...]]] = {
    0: [("claim", "a"), ("done",)],
    1: [("claim", "a"), ("release",), ("claim", "b"), ("done",)],
    2: [("claim", "a"), ("expire",), ("claim", "b"), ("done",)],
    3: [("claim", "a"), ("recover",), ("done",)],
    4: [("claim", "a"), ("recover",)],                                     # a holds it (recovered)
    5: [("claim", "a"), ("fail",), ("claim", "b"), ("fail",), ("claim", "c"), ("fail",),  # failed
        ("requeue",), ("claim", "a"), ("done",)],
    6: [("claim", "a"), ("done",), ("requeue",), ("claim", "b")],           # b holds it
    7: [("claim", "c")],                                                    # c holds it
    8: [("claim", "a"), ("requeue",), ("claim", "b"), ("done",)],           # a requeued claimed item
    9: [("claim", "a"), ("orphan",)],                                       # its end was never written
    10: [("claim", "a"), ("cover",)],
    12: [("claim", "a"), ("recover",), ("recover",), ("recover",)],         # the third one fails it
    13: [("claim", "a"), ("claim", "b")],                      # a's end never written; b holds it
}  # 11, 14, 15: never claimed


def write_old_history(engine: sa.Engine, sqlite: bool) -> None:
    with engine.begin() as c:
        old = OldCode(c, sqlite)
        for seq, script in SCRIPTS.items():
            for step in script:
                if step[0] == "claim":
                    old.claim(seq, step[1])
                elif step[0] == "orphan":  # the item went back without a row (a lost write)
                    old.x("UPDATE wq_items SET state = 'pending', token = NULL WHERE queue_id = :q "
                          "AND epoch = 0 AND seq = :s", q=old.qid, s=seq)
                elif step[0] == "cover":
                    old.done(seq, "checkpoint step 5")
                else:
                    getattr(old, step[0])(seq)


def test_history_written_at_0004_reads_the_same_after_0005(engine: sa.Engine, empty_db_url: str,
                                                           backend: str) -> None:
    with WorkQueue(WORKS, shuffle=False, name=QUEUE, url=empty_db_url, worker="maker",
                   max_attempts=MAX_ATTEMPTS):
        pass  # the queue, its works and epoch 0; no delivery
    migrate_to(engine, "0004", down=True)
    write_old_history(engine, backend == "sqlite")
    before = history(engine)
    assert sorted(before) == sorted(SCRIPTS)
    assert [k for k, *_ in before[13]] == ["claim", "claim"] and before[4][-1][0] == "recover"

    migrate_to(engine, "head")
    assert history(engine) == before

    with engine.connect() as c:
        stored = c.execute(sa.text(
            "SELECT e.seq, e.kind, w.name, e.claimed_at, e.attempt FROM wq_events e "
            "LEFT JOIN wq_workers w ON w.id = e.worker_id ORDER BY e.id")).all()
    by_seq: dict[int, list[tuple[Any, ...]]] = {}
    for seq, kind, who, claimed_at, attempt in stored:
        by_seq.setdefault(seq, []).append((kind, who, attempt, claimed_at))
    claim_at = {(seq, n): ev[2] for seq, evs in before.items()
                for n, ev in enumerate(e for e in evs if e[0] == "claim")}
    # One row per ended delivery: a claim folded into its end (claimed_at = the claim's time,
    # attempt = failed attempts before it); in-flight claims dropped; claims never ended kept.
    assert by_seq[0] == [("done", "a", 0, claim_at[0, 0])]
    assert by_seq[1] == [("release", "a", 0, claim_at[1, 0]), ("done", "b", 0, claim_at[1, 1])]
    assert by_seq[2] == [("expire", "a", 0, claim_at[2, 0]), ("done", "b", 1, claim_at[2, 1])]
    assert by_seq[3] == [("recover", "a", 0, claim_at[3, 0]), ("done", "a", 1, claim_at[3, 0])]
    assert by_seq[4] == [("recover", "a", 0, claim_at[4, 0])]
    assert by_seq[5] == [("fail", "a", 0, claim_at[5, 0]), ("fail", "b", 1, claim_at[5, 1]),
                         ("fail", "c", 2, claim_at[5, 2]), ("requeue", "c", None, None),
                         ("done", "a", 0, claim_at[5, 3])]
    assert by_seq[6] == [("done", "a", 0, claim_at[6, 0]), ("requeue", "a", None, None)]
    assert 7 not in by_seq
    assert by_seq[8] == [("requeue", "a", 0, claim_at[8, 0]), ("done", "b", 0, claim_at[8, 1])]
    assert by_seq[9] == [("claim", "a", 0, claim_at[9, 0])]
    assert by_seq[12] == [("recover", "a", 0, claim_at[12, 0]), ("recover", "a", 1, claim_at[12, 0]),
                          ("fail", "a", 2, claim_at[12, 0])]
    assert by_seq[13] == [("claim", "a", 0, claim_at[13, 0])]

    # Back to 0004: the old form, with the same history.
    migrate_to(engine, "0004", down=True)
    assert history(engine) == before
    with engine.connect() as c:
        claims = c.execute(sa.text("SELECT count(*) FROM wq_events WHERE kind = 'claim'")).scalar_one()
    assert claims == sum(1 for evs in before.values() for ev in evs if ev[0] == "claim") == 21
    migrate_to(engine, "head")
    assert history(engine) == before

    # Today's code carries on: "a" restarts and takes back 4; b's and c's items expire (their
    # leases ran out in January); everything else pending is claimed, and all gets done.
    with WorkQueue(WORKS, shuffle=False, name=QUEUE, url=empty_db_url, worker="a",
                   max_attempts=MAX_ATTEMPTS, poll_seconds=0.05) as wq:
        got = [(i.seq, i.attempts) for i in wq]
    assert got[0] == (4, 2), got  # recovered first, its third attempt
    after = history(engine)
    for seq, old in before.items():
        if seq in (0, 1, 2, 3, 5, 8, 10, 12):
            assert after[seq] == old, seq  # ended: nothing new
        else:
            assert after[seq][:len(old)] == old, seq  # the old history, then what happened today
    def new(seq: int) -> list[tuple[str, str]]:
        return [(k, w) for k, w, *_ in after[seq][len(before.get(seq, [])):]]

    assert new(4) == [("recover", "a"), ("done", "a")]
    assert new(6) == [("expire", "b"), ("claim", "a"), ("done", "a")]
    assert new(7) == [("expire", "c"), ("claim", "a"), ("done", "a")]
    assert new(11) == [("claim", "a"), ("done", "a")]
    with engine.connect() as c:
        q = c.execute(sa.text("SELECT * FROM wq_queues WHERE name = :q"), {"q": QUEUE}).one()
        a = report.audit(c, q)
    # 9 and 13's lost ends left their items pending or re-claimed: they were done today, once.
    assert a.ok, (a.violations, a.counter_mismatches)
    assert {r["seq"] for r in a.redeliveries} == {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13}
    assert [r["deliveries"] for r in a.redeliveries if r["seq"] == 13] == [3]  # a, b, then a today
