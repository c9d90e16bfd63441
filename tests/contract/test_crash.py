"""Crashes, stalls and identities, with real processes and real signals.

A worker process (``worker_proc.py``) prints ``HOLDING <epoch> <seq> <work>`` once it holds an
un-acked item; the tests then SIGKILL or SIGSTOP it and check, by SQL over ``wq_audit`` and
``wq_history`` and by the workers' own logs, who gets the item and when. Times are compared on
the database clock (lease_until against event times), never against tight wall-clock bounds.
"""

from __future__ import annotations

import collections
import random
import signal
import sqlite3
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from worker_proc import Proc, make_works, query, query_commit, received_multiset

from wq_sql import WorkQueue
from wq_sql.store import statements
from wq_sql.store.hot.renew import Renewal
from wq_sql.worker.heartbeat import LOOKS_PER_HOST, looks_this_beat


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Worker processes started by the test; whatever is still running at the end is killed."""
    started: list[Proc] = []
    yield started
    for p in started:
        p.cleanup()


def start(procs: list[Proc], url: str, name: str, worker: str, tmp_path: Path, n_works: int,
          tag: str = "", **opts: Any) -> Proc:
    p = Proc(url, name, worker, tmp_path / f"{worker}{tag}.log", n_works, **opts)
    procs.append(p)
    return p


def holding(p: Proc, timeout: float = 60) -> tuple[int, int, str]:
    _, e, s, w = p.expect("HOLDING", timeout).split(" ")
    return int(e), int(s), w


def history(url: str, name: str, epoch: int, seq: int) -> list[Any]:
    return query(url, "SELECT kind, worker, at, detail FROM wq_history WHERE queue = :q AND epoch = :e "
                      "AND seq = :s ORDER BY event_id", q=name, e=epoch, s=seq)


def audit(url: str, name: str, epoch: int, seq: int) -> Any:
    rows = query(url, "SELECT * FROM wq_audit WHERE queue = :q AND epoch = :e AND seq = :s",
                 q=name, e=epoch, s=seq)
    assert len(rows) == 1
    return rows[0]


def lease_until(url: str, name: str, epoch: int, seq: int) -> Any:
    return query(url, "SELECT i.lease_until FROM wq_items i JOIN wq_queues q ON q.id = i.queue_id "
                      "WHERE q.name = :q AND i.epoch = :e AND i.seq = :s", q=name, e=epoch, s=seq)[0][0]


def ts(value: Any) -> datetime:
    """A timestamp read through plain ``text()`` SQL: SQLite returns the stored text."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value[:26])
    return value.replace(tzinfo=None)


def assert_all_done_once(url: str, name: str, total: int) -> None:
    assert dict(query(url, "SELECT state, count(*) FROM wq_audit WHERE queue = :q GROUP BY state",
                      q=name)) == {"done": total}
    assert query(url, "SELECT item_id FROM wq_history WHERE queue = :q GROUP BY item_id "
                      "HAVING sum(CASE WHEN kind = 'done' THEN 1 ELSE 0 END) <> 1", q=name) == []


def writer_busy(url: str, backend: str) -> bool:
    """Whether some other session is inside a write transaction right now."""
    if backend == "sqlite":
        con = sqlite3.connect(url.split("///", 1)[1], timeout=0, isolation_level=None)
        try:
            con.execute("BEGIN IMMEDIATE")
            con.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError:
            return True
        finally:
            con.close()
    return query(url, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                      "AND pid <> pg_backend_pid() AND backend_type = 'client backend' "
                      "AND state <> 'idle'")[0][0] > 0


def stop_between_transactions(stale: list[Proc], url: str, backend: str) -> None:
    """SIGSTOP the processes at a moment none of them is inside a transaction.

    A process stopped inside a transaction holds SQLite's write lock (everyone waits for it) or
    Postgres row locks that SKIP LOCKED passes over until the idle-in-transaction timeout. That
    is a different test; here the stale worker must hold only its lease."""
    for _ in range(100):
        for p in stale:
            p.signal(signal.SIGSTOP)
        for p in stale:  # wait until the kernel has actually stopped them
            deadline = time.monotonic() + 10
            while Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
                assert time.monotonic() < deadline, f"{p.worker} did not stop"
                time.sleep(0.01)
        if not writer_busy(url, backend):
            return
        for p in stale:
            p.signal(signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError("could not stop the workers between two transactions")


# ---------------------------------------------------------------- SIGKILL


def test_sigkill_same_identity_gets_its_item_back_first(db_url: str, tmp_path: Path,
                                                       procs: list[Proc]) -> None:
    """Killed while holding an un-acked item (and one claimed ahead): the restarted worker with
    the same identity gets exactly that item first, at once (a ``recover``, no lease expiry)."""
    n, name = 20, "kill"
    works = make_works(n)
    a = start(procs, db_url, name, "k", tmp_path, n, tag="-1", shuffle=0, lease=60, lease_ahead=2, hold=3)
    e, s, w = holding(a)
    assert (e, s, w) == (0, 2, works[2])
    assert audit(db_url, name, 0, 1).state == "done"  # acked by the third take
    a.kill()

    b = start(procs, db_url, name, "k", tmp_path, n, tag="-2", shuffle=0, lease=60, lease_ahead=2)
    assert b.finish(timeout=60) == 0, b.stderr()
    assert b.lines[-1] == "EXHAUSTED 20 0"
    got_b = b.received()
    assert got_b[0] == (0, 2, works[2])        # the un-acked item first
    assert got_b[1] == (0, 3, works[3])        # then the one claimed ahead (never handed out)
    assert "recovered 2 item(s)" in b.stderr()

    # Exactly the un-acked item was delivered twice.
    assert a.received() == [(0, s, works[s]) for s in range(3)]
    assert received_multiset([a, b]) == collections.Counter(works + [works[2]])
    assert_all_done_once(db_url, name, n)
    h = history(db_url, name, 0, 2)
    assert [(r.kind, r.worker) for r in h] == [("claim", "k"), ("recover", "k"), ("done", "k")]
    # Taken back long before the 60 s lease ran out, and nothing expired.
    assert query(db_url, "SELECT count(*) FROM wq_history WHERE kind = 'expire'") == [(0,)]
    assert audit(db_url, name, 0, 2).attempts == 1
    assert audit(db_url, name, 0, 3).attempts == 1  # the crash counts for the claimed-ahead item too
    assert audit(db_url, name, 0, 4).attempts == 0


def test_sigkill_on_this_host_gives_the_item_to_another_worker_at_once(
        db_url: str, tmp_path: Path, procs: list[Proc]) -> None:
    """A worker on this host is SIGKILLed holding an item (identity not restarted): a live
    worker sees that its process is gone at its next heartbeat and returns the item, logged at
    WARNING with the dead worker's name, long before the 60 s lease runs out."""
    n, name = 12, "deadpid"
    works = make_works(n)
    a = start(procs, db_url, name, "dead", tmp_path, n, shuffle=0, lease=60, heartbeat=0.5, hold=1)
    barrier = tmp_path / "go"
    b = start(procs, db_url, name, "other", tmp_path, n, shuffle=0, lease=60, heartbeat=0.5,
              barrier=barrier)
    assert holding(a) == (0, 0, works[0])
    b.expect("READY")
    a.kill()
    barrier.touch()
    until = lease_until(db_url, name, 0, 0)

    assert b.finish(timeout=60) == 0, b.stderr()
    assert b.lines[-1] == f"EXHAUSTED {n} 0"
    assert sorted(b.received()) == [(0, s, works[s]) for s in range(n)]
    h = history(db_url, name, 0, 0)
    assert [(r.kind, r.worker) for r in h] == [("claim", "dead"), ("expire", "dead"),
                                               ("claim", "other"), ("done", "other")]
    assert h[1].detail.startswith("worker 'dead' died (its process"), h[1].detail
    assert (ts(until) - ts(h[1].at)).total_seconds() > 40, (until, h)  # the lease had most of its time
    assert "WARNING" in b.stderr() and "worker 'dead' died" in b.stderr(), b.stderr()
    assert audit(db_url, name, 0, 0).attempts == 1
    assert_all_done_once(db_url, name, n)


def test_a_worker_elsewhere_that_stops_heartbeating_is_gone_after_three_beats(
        db_url: str, tmp_path: Path, procs: list[Proc]) -> None:
    """A worker on another host (its row says so) stops heartbeating: after 3 of its heartbeat
    periods, well before its 60 s lease, a live worker returns its item."""
    n, name = 6, "silent"
    works = make_works(n)
    a = start(procs, db_url, name, "far", tmp_path, n, shuffle=0, lease=60, heartbeat=0.5, hold=1)
    barrier = tmp_path / "go"
    b = start(procs, db_url, name, "near", tmp_path, n, shuffle=0, lease=60, heartbeat=0.5,
              barrier=barrier)
    assert holding(a) == (0, 0, works[0])
    b.expect("READY")
    query_commit(db_url, "UPDATE wq_workers SET host = 'elsewhere.example' WHERE name = 'far'")
    a.kill()
    barrier.touch()
    until = lease_until(db_url, name, 0, 0)

    assert b.finish(timeout=60) == 0, b.stderr()
    assert b.lines[-1] == f"EXHAUSTED {n} 0"
    h = history(db_url, name, 0, 0)
    assert [(r.kind, r.worker) for r in h] == [("claim", "far"), ("expire", "far"),
                                               ("claim", "near"), ("done", "near")]
    assert h[1].detail.startswith("worker 'far' stopped heartbeating (last heartbeat "), h[1].detail
    assert "on elsewhere.example" in h[1].detail
    last_beat = query(db_url, "SELECT heartbeat_at FROM wq_workers WHERE name = 'far'")[0][0]
    waited = (ts(h[1].at) - ts(last_beat)).total_seconds()
    assert 1.5 <= waited < 30, (last_beat, h)
    assert (ts(until) - ts(h[1].at)).total_seconds() > 30
    assert "worker 'far' stopped heartbeating" in b.stderr()
    assert_all_done_once(db_url, name, n)


def test_on_a_busy_host_a_few_workers_look_for_lost_items_per_beat() -> None:
    """Every worker looking at every beat would cost N x N row reads per heartbeat period: the
    looks are sampled so that about LOOKS_PER_HOST workers of a host look per period."""
    rng = random.Random(7)
    assert all(looks_this_beat(n, 0.999) for n in range(1, LOOKS_PER_HOST + 1))
    for n in (8, 100, 2000):
        draws = 100_000
        per_period = sum(looks_this_beat(n, rng.random()) for _ in range(draws)) / draws * n
        assert per_period == pytest.approx(LOOKS_PER_HOST, rel=0.15), n


def test_workers_that_start_together_do_not_all_look_at_their_first_beat(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers started together beat together. If each one's first beat looked for lost items
    (knowing no worker count yet), N looks would read N x N worker rows at the same moment: the
    200-worker long tail's ~1 s takes (bench/cluster_scale.py tail). The first beat counts this
    host's workers instead, so that about LOOKS_PER_HOST of them look, as at every later beat."""
    n, name, beat = 32, "firstbeat", 2.0
    WorkQueue(make_works(4), name=name, url=db_url, worker="creator").close()
    qs: list[WorkQueue] = []
    by_id: dict[int, list[tuple[str, float]]] = collections.defaultdict(list)
    logs: list[list[tuple[str, float]]] = []  # per worker: (renew or look, when), in order
    real = Renewal.run

    def renew(self: Renewal, conn: Any, prefix: str, qid: int, worker_id: int, *args: Any, **kw: Any) -> Any:
        by_id[worker_id].append(("renew", time.monotonic()))  # the renewal: one driver-level query
        return real(self, conn, prefix, qid, worker_id, *args, **kw)

    def recorder(log: list[tuple[str, float]]) -> Any:
        def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if "AS held" in statement:  # statements.holders_to_check: the look's first read
                log.append(("look", time.monotonic()))
        return before

    monkeypatch.setattr(Renewal, "run", renew)
    try:
        for i in range(n):
            q = WorkQueue.attach(name, url=db_url, worker=f"w{i}", heartbeat_seconds=beat)
            logs.append(by_id[q.worker_id])
            event.listen(q.engine, "before_cursor_execute", recorder(logs[-1]))
            qs.append(q)
        all_in = time.monotonic()
        deadline = all_in + 60
        while time.monotonic() < deadline and not all(
                sum(k == "renew" for k, _ in log) >= 2 for log in logs):
            time.sleep(0.1)
    finally:
        for q in qs:
            q.close()
    # Workers whose first beat came once all had joined: each looked at it iff a look came
    # before its second renew.
    firsts = [log for log in logs if len(log) >= 2 and log[0][0] == "renew" and log[0][1] >= all_in]
    looked = sum(log[1][0] == "look" for log in firsts)
    assert len(firsts) >= 8, f"joining {n} workers took longer than the first beats: {len(firsts)}"
    # Each looks with probability LOOKS_PER_HOST / n: all of them, or a third more, is < 1e-5.
    assert looked < len(firsts) and looked <= LOOKS_PER_HOST + len(firsts) // 3, (looked, len(firsts))


def test_sigkill_on_a_busy_host_comes_back_within_a_few_beats(
        db_url: str, tmp_path: Path, procs: list[Proc]) -> None:
    """With 12 more workers on this host (so each looks at about a third of its beats), a
    SIGKILLed worker's item still comes back within a few heartbeats, not after the lease."""
    n, name = 4, "busyhost"
    works = make_works(n)
    a = start(procs, db_url, name, "dead", tmp_path, n, shuffle=0, lease=60, heartbeat=0.5, hold=1)
    assert holding(a) == (0, 0, works[0])
    idle = [WorkQueue.attach(name, url=db_url, worker=f"idle{i}", lease_seconds=60, heartbeat_seconds=0.5)
            for i in range(12)]
    try:
        time.sleep(1.5)  # each has beaten and counted this host's workers: it looks at a few beats
        a.kill()
        killed = time.monotonic()
        while time.monotonic() - killed < 30:
            if [r.kind for r in history(db_url, name, 0, 0)][-1] == "expire":
                break
            time.sleep(0.1)
        back = time.monotonic() - killed
    finally:
        for q in idle:
            q.close()
    h = history(db_url, name, 0, 0)
    assert [r.kind for r in h] == ["claim", "expire"], h
    assert h[1].detail.startswith("worker 'dead' died (its process"), h[1].detail
    assert back < 10, back  # 60 s lease; P(no look in 10 s) is below 1e-30


def test_an_older_workers_item_comes_back_only_after_the_lease(db_url: str, tmp_path: Path,
                                                               procs: list[Proc]) -> None:
    """A worker that does not say how often it beats (a row written before the liveness rule,
    ``beat_seconds`` NULL) on another host: the other worker, polling all along, gets its item
    only once the lease ran out; the ``expire`` event names the dead worker as the holder."""
    n, name, lease = 12, "expiry", 4.0
    works = make_works(n)
    a = start(procs, db_url, name, "dead", tmp_path, n, shuffle=0, lease=lease, heartbeat=0.5, hold=1)
    barrier = tmp_path / "go"
    b = start(procs, db_url, name, "other", tmp_path, n, shuffle=0, lease=lease, heartbeat=0.5,
              barrier=barrier)
    assert holding(a) == (0, 0, works[0])
    b.expect("READY")
    query_commit(db_url, "UPDATE wq_workers SET host = 'elsewhere.example', beat_seconds = NULL "
                         "WHERE name = 'dead'")
    a.kill()
    barrier.touch()
    until = lease_until(db_url, name, 0, 0)  # no heartbeat renews it any more

    assert b.finish(timeout=60) == 0, b.stderr()
    assert b.lines[-1] == f"EXHAUSTED {n} 0"
    got_b = b.received()
    assert got_b[-1] == (0, 0, works[0])       # the dead worker's item came last
    assert sorted(got_b) == [(0, s, works[s]) for s in range(n)]

    h = history(db_url, name, 0, 0)
    assert [(r.kind, r.worker, r.detail) for r in h][:2] == [("claim", "dead", None),
                                                             ("expire", "dead", "lease expired")]
    assert [(r.kind, r.worker) for r in h][2:] == [("claim", "other"), ("done", "other")]
    assert ts(h[1].at) >= ts(until) and ts(h[2].at) >= ts(until), (until, h)
    # "other" was taking (and then polling) while the lease still ran.
    first_claim = query(db_url, "SELECT min(at) FROM wq_history WHERE kind = 'claim' AND worker = 'other'")
    assert ts(first_claim[0][0]) < ts(until)
    assert audit(db_url, name, 0, 0).attempts == 1
    assert_all_done_once(db_url, name, n)


def test_a_look_writes_only_when_a_lease_has_expired(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The look for lost items reads first; its write transaction (``statements.expire``: on SQLite a
    turn of the machine's write lock) runs only when the read saw an expired lease."""
    expiring: list[int] = []
    real = statements.expire

    def expire(*args: Any, **kwargs: Any) -> int:
        n = real(*args, **kwargs)
        expiring.append(n)
        return n

    monkeypatch.setattr(statements, "expire", expire)
    name = "lookwrites"
    # "slow" beats every 30 s: it does not renew its item while "looker" (2 workers on this
    # host: it looks at every beat) looks every 0.3 s.
    with WorkQueue(make_works(3), name=name, url=db_url, worker="slow", heartbeat_seconds=30,
                   lease_seconds=90, lease_ahead=1, shuffle=False) as slow, \
            WorkQueue.attach(name, url=db_url, worker="looker", heartbeat_seconds=0.3, lease_seconds=30):
        assert slow.take() == make_works(3)[0]
        time.sleep(1.5)  # about 5 beats of the looker, each a look
        assert expiring == [], "a look with no expired lease wrote"
        query_commit(db_url, "UPDATE wq_items SET lease_until = :t WHERE state = 'claimed'",
                     t="2000-01-01 00:00:00.000000")
        deadline = time.monotonic() + 20
        while not expiring and time.monotonic() < deadline:
            time.sleep(0.05)
        assert expiring and expiring[0] == 1
        assert [(r.kind, r.worker, r.detail) for r in history(db_url, name, 0, 0)] == [
            ("claim", "slow", None), ("expire", "slow", "lease expired")]


# ---------------------------------------------------------------- SIGSTOP: a stale worker


def test_sigstop_past_the_lease_then_stale_acks_are_rejected(db_url: str, backend: str, tmp_path: Path,
                                                             procs: list[Proc]) -> None:
    """Two workers are stopped holding an item each, past their lease; a third one takes and
    completes both items. Continued, the first one's explicit complete() raises LeaseLost, the
    second one's implicit ack (its next take()) is rejected; each item is done exactly once."""
    n, name, lease = 10, "stale", 2.0
    works = make_works(n)
    opts: dict[str, Any] = dict(shuffle=0, lease=lease, heartbeat=0.3)
    explicit = start(procs, db_url, name, "explicit", tmp_path, n, hold=1, **opts)
    held_x = holding(explicit)
    implicit = start(procs, db_url, name, "implicit", tmp_path, n, hold=1, **opts)
    held_i = holding(implicit)
    assert {held_x[1], held_i[1]} == {0, 1}
    stop_between_transactions([explicit, implicit], db_url, backend)

    fresh = start(procs, db_url, name, "fresh", tmp_path, n, **opts)
    assert fresh.finish(timeout=60) == 0, fresh.stderr()
    assert fresh.lines[-1] == f"EXHAUSTED {n} 0"
    assert sorted(fresh.received()) == [(0, s, works[s]) for s in range(n)]

    for p in (explicit, implicit):
        p.signal(signal.SIGCONT)
    explicit.send("complete")
    assert explicit.expect(("LEASELOST", "COMPLETED"), timeout=30) == "LEASELOST"
    explicit.send("exit")
    implicit.send("take")
    assert implicit.expect("EXHAUSTED", timeout=30) == f"EXHAUSTED {n} 0"
    for p in (explicit, implicit):
        assert p.finish(timeout=30) == 0, p.stderr()
    assert "LeaseLost" not in implicit.stderr()
    assert f"their completion was rejected: (epoch 0, seq {held_i[1]})" in implicit.stderr()

    for (e, s, _), stale in ((held_x, "explicit"), (held_i, "implicit")):
        h = history(db_url, name, e, s)
        assert [(r.kind, r.worker) for r in h] == [("claim", stale), ("expire", stale),
                                                   ("claim", "fresh"), ("done", "fresh")]
        row = audit(db_url, name, e, s)
        assert (row.state, row.worker, row.attempts) == ("done", "fresh", 1)
    assert_all_done_once(db_url, name, n)
    assert received_multiset([explicit, implicit, fresh]) == collections.Counter(
        works + [held_x[2], held_i[2]])


@pytest.mark.parametrize("ack", ["complete", "take"])
def test_stale_ack_is_fenced_while_another_worker_holds_the_item(
        db_url: str, backend: str, tmp_path: Path, procs: list[Proc], ack: str) -> None:
    """The stale worker acks while the item is *claimed* by the worker that took it over (not yet
    done): the token, not the state, must reject it, for ``complete()`` and for the implicit ack
    sent with the next claim; the new holder then completes it normally."""
    n, name, lease = 4, "fence", 2.0
    works = make_works(n)
    opts: dict[str, Any] = dict(shuffle=0, lease=lease, heartbeat=0.3)
    stale = start(procs, db_url, name, "stale", tmp_path, n, hold=1, **opts)
    assert holding(stale) == (0, 0, works[0])
    stop_between_transactions([stale], db_url, backend)
    fresh = start(procs, db_url, name, "fresh", tmp_path, n, hold=n, **opts)
    assert holding(fresh) == (0, 0, works[0])  # the other items first, then this one once expired
    token = query(db_url, "SELECT token FROM wq_items WHERE epoch = 0 AND seq = 0")[0][0]

    stale.signal(signal.SIGCONT)
    stale.send(ack)
    if ack == "complete":
        assert stale.expect(("LEASELOST", "COMPLETED"), timeout=30) == "LEASELOST"
    else:
        deadline = time.monotonic() + 30
        while "their completion was rejected: (epoch 0, seq 0)" not in stale.stderr():
            assert time.monotonic() < deadline, stale.stderr()
            time.sleep(0.05)
    row = audit(db_url, name, 0, 0)
    assert (row.state, row.worker) == ("claimed", "fresh")
    assert query(db_url, "SELECT token FROM wq_items WHERE epoch = 0 AND seq = 0") == [(token,)]

    fresh.send("complete")
    assert fresh.expect(("LEASELOST", "COMPLETED"), timeout=30) == "COMPLETED"
    fresh.send("exit")
    if ack == "complete":
        stale.send("exit")
    else:
        assert stale.expect("EXHAUSTED", timeout=30) == f"EXHAUSTED {n} 0"
    for p in (stale, fresh):
        assert p.finish(timeout=30) == 0, p.stderr()
    assert [(r.kind, r.worker) for r in history(db_url, name, 0, 0)] == [
        ("claim", "stale"), ("expire", "stale"), ("claim", "fresh"), ("done", "fresh")]
    assert_all_done_once(db_url, name, n)
    assert stale.received() == [(0, 0, works[0])]


def test_live_worker_keeps_its_item_for_three_leases(db_url: str, tmp_path: Path,
                                                     procs: list[Proc]) -> None:
    """A live, heartbeating worker holds an item for more than 3 leases while another worker
    polls for work the whole time: the item is never re-delivered."""
    n, name, lease = 8, "live", 2.0
    works = make_works(n)
    opts: dict[str, Any] = dict(shuffle=0, lease=lease, heartbeat=0.3)
    holder = start(procs, db_url, name, "holder", tmp_path, n, hold=1, **opts)
    assert holding(holder) == (0, 0, works[0])
    held_since = time.monotonic()
    poller = start(procs, db_url, name, "poller", tmp_path, n, poll=0.2, **opts)
    deadline = time.monotonic() + 60
    while len(poller.received()) < n - 1:
        assert time.monotonic() < deadline, poller.stderr()
        time.sleep(0.1)
    time.sleep(max(0.0, 3 * lease + 0.5 - (time.monotonic() - held_since)))

    assert poller.p.poll() is None, poller.stderr()  # still waiting for the held item
    row = audit(db_url, name, 0, 0)
    assert (row.state, row.worker, row.attempts) == ("claimed", "holder", 0)
    holder.send("complete")
    assert holder.expect("COMPLETED", timeout=30) == "COMPLETED"
    assert poller.finish(timeout=60) == 0, poller.stderr()
    assert poller.lines[-1] == f"EXHAUSTED {n} 0"
    holder.send("exit")
    assert holder.finish(timeout=30) == 0, holder.stderr()

    assert (0, 0, works[0]) not in poller.received()
    h = history(db_url, name, 0, 0)
    assert [(r.kind, r.worker) for r in h] == [("claim", "holder"), ("done", "holder")]
    assert (ts(h[1].at) - ts(h[0].at)).total_seconds() >= 3 * lease
    assert query(db_url, "SELECT count(*) FROM wq_history WHERE kind = 'expire'") == [(0,)]
    assert_all_done_once(db_url, name, n)


# ---------------------------------------------------------------- worker identity


def test_worker_identity_is_exclusive_and_taken_over_after_death(db_url: str, tmp_path: Path,
                                                                 procs: list[Proc]) -> None:
    """A second live process with the same worker= fails fast with WorkerConflict and takes
    nothing; once the first is SIGKILLed, a new one starts at once and gets its item back."""
    n, name = 10, "ident"
    works = make_works(n)
    first = start(procs, db_url, name, "same", tmp_path, n, tag="-1", shuffle=0, lease=60, hold=1)
    assert holding(first) == (0, 0, works[0])

    second = start(procs, db_url, name, "same", tmp_path, n, tag="-2", shuffle=0, lease=60)
    assert second.wait(timeout=60) == 3, second.stderr()
    conflict = second.expect("CONFLICT", timeout=10)
    assert float(conflict.split()[1]) < 10  # decided quickly, not after a lease
    assert "already held by a live process" in second.stderr()
    assert second.received() == []
    row = audit(db_url, name, 0, 0)
    assert (row.state, row.worker, row.attempts) == ("claimed", "same", 0)
    assert [r.kind for r in history(db_url, name, 0, 0)] == ["claim"]
    assert query(db_url, "SELECT pid FROM wq_workers WHERE name = 'same'") == [(first.pid,)]

    first.kill()
    third = start(procs, db_url, name, "same", tmp_path, n, tag="-3", shuffle=0, lease=60)
    started = third.expect("STARTED", timeout=60)
    assert float(started.split()[1]) < 10  # far less than the 60 s lease
    assert third.finish(timeout=60) == 0, third.stderr()
    assert third.received()[0] == (0, 0, works[0])
    assert [(r.kind, r.worker) for r in history(db_url, name, 0, 0)] == [
        ("claim", "same"), ("recover", "same"), ("done", "same")]
    assert query(db_url, "SELECT pid FROM wq_workers WHERE name = 'same'") == [(third.pid,)]
    assert_all_done_once(db_url, name, n)


def test_worker_identity_held_from_another_host_is_judged_by_heartbeat_age(
        db_url: str, tmp_path: Path, procs: list[Proc]) -> None:
    """When the holder of an identity registered from another host (no process check possible),
    its heartbeat decides: fresh means live (WorkerConflict), stale for 3 heartbeats means dead
    (taken over, its item taken back long before the lease ends)."""
    n, name, lease, beat = 6, "xhost", 60.0, 0.5
    works = make_works(n)
    first = start(procs, db_url, name, "roaming", tmp_path, n, tag="-1", shuffle=0, lease=lease,
                  heartbeat=beat, hold=1)
    assert holding(first) == (0, 0, works[0])
    query_commit(db_url, "UPDATE wq_workers SET host = 'elsewhere.example' WHERE name = 'roaming'")

    second = start(procs, db_url, name, "roaming", tmp_path, n, tag="-2", shuffle=0, lease=lease,
                   heartbeat=beat)
    assert second.wait(timeout=60) == 3, second.stderr()
    assert "elsewhere.example" in second.stderr()
    assert second.received() == []
    assert [r.kind for r in history(db_url, name, 0, 0)] == ["claim"]

    first.kill()
    third = start(procs, db_url, name, "roaming", tmp_path, n, tag="-3", shuffle=0, lease=lease,
                  heartbeat=beat)
    started = third.expect("STARTED", timeout=60)
    assert float(started.split()[1]) < 20  # about 3 heartbeats, far less than the 60 s lease
    assert third.finish(timeout=60) == 0, third.stderr()
    assert third.received()[0] == (0, 0, works[0])
    assert [(r.kind, r.worker) for r in history(db_url, name, 0, 0)] == [
        ("claim", "roaming"), ("recover", "roaming"), ("done", "roaming")]
    assert_all_done_once(db_url, name, n)
