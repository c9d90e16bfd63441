"""Chaos on PostgreSQL, short form (CI): the server restarted or crashed mid-drain, worker backends
terminated, transactions held across items, and foreign transactions. Every test runs on a
throwaway cluster that this module starts itself (``tests/support/pgcluster.py``), never on the machine's
shared server. Under ``$CI`` a cluster that cannot be made fails the module; elsewhere it skips.

The drains use real worker processes (``tests/support/worker_proc.py``) taking a 3-epoch queue, each item
costing ``ITEM_MS``. Afterwards (``_check_drain``):

* ``wq_audit``: every ``(epoch, seq)`` of every epoch is ``done``, nothing else.
* The history, one row per delivery, replayed per item (``tests/support/deliveries.py``, which also
  checks that an item's deliveries never overlap, that the ``done`` is its holder's, and that
  ``wq_history`` shows one ``claim`` per delivery): every delivery ends either in ``done`` or is
  *abandoned* (an ``expire``: nobody releases, fails or restarts an identity here); exactly one
  ``done`` per item; and every abandoned delivery was open across a disruption (claimed before
  the disruption ended, expired after it began): items claimed but not acknowledged when the
  server went away whose lease ran out during the outage, or items whose claim committed while
  its reply was lost.
* The workers' own logs (one line per item received): every item received, and an item received
  more than once only if its history has an abandoned delivery; never more often than claimed.

Run as a script, this file measures claim latency with and without a foreign transaction holding
an old snapshot (``measure_old_snapshot``; numbers in BENCHMARKS.md). It is not a test: at the
few thousand claims CI could afford the two are indistinguishable, and the growth it shows is a
trend, not a pass/fail line::

    .venv/bin/python tests/postgres/test_chaos_pg.py --claims 20000 --runs 3
    .venv/bin/python tests/postgres/test_chaos_pg.py --claims 60000 --buffers   # why: buffers per statement
"""

from __future__ import annotations

import collections
import datetime as dt
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import sqlalchemy as sa

# pgcluster, worker_proc when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from deliveries import replay  # noqa: E402
from pgcluster import PgCluster, PgClusterError  # noqa: E402
from worker_proc import Proc, make_works, query  # noqa: E402

QUEUE = "chaos_pg"
N_WORKS, EPOCHS, N_PROCS = 40, 3, 4
ITEM_MS = 50.0
# Short leases so that a claim whose commit reached the server but whose reply was lost (the
# worker never learns of it) comes back within seconds instead of a minute.
LEASE, HEARTBEAT = 5.0, 0.5
# fsync=off: a crash here is of the server processes, not the machine, so the kernel keeps every
# write; synchronous_commit stays on, so an acknowledged commit survives `-m immediate`.
SETTINGS: dict[str, Any] = {"fsync": "off", "max_connections": 100, "autovacuum": "on"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[PgCluster]:
    pg: Optional[PgCluster] = None
    try:
        pg = PgCluster(SETTINGS)
        pg.start()
    except (PgClusterError, OSError) as e:
        if pg is not None:
            pg.close()
        msg = f"cannot make a throwaway PostgreSQL cluster: {e}"
        if os.environ.get("CI"):
            pytest.fail(msg + "\nthe Postgres chaos tests are required in CI", pytrace=False)
        pytest.skip(msg)
    try:
        yield pg
    finally:
        pg.close()


def fresh_url(pg: PgCluster) -> str:
    """A new database on the throwaway cluster, migrated to head."""
    import wq_sql

    url = pg.create_database(f"chaos_{uuid.uuid4().hex[:10]}")
    wq_sql.upgrade(url)
    return url


@pytest.fixture
def url(cluster: PgCluster) -> str:
    return fresh_url(cluster)


def _db(url: str) -> str:
    return url.rsplit("/", 1)[1]


# ---------------------------------------------------------------- the drain and its checks


@dataclass
class Disruption:
    what: str
    start: dt.datetime  # database clock just before it
    end: dt.datetime    # database clock once the server answered again


def _now(pg: PgCluster) -> dt.datetime:
    return pg.sql("SELECT clock_timestamp()")[0][0]  # type: ignore[no-any-return]


class Drain:
    """``N_PROCS`` worker processes draining ``N_WORKS x EPOCHS`` items of a queue the test made."""

    def __init__(self, url: str, tmp: Path, *, n_works: int = N_WORKS, epochs: int = EPOCHS,
                 item_ms: float = ITEM_MS, n_procs: int = N_PROCS) -> None:
        from wq_sql import WorkQueue

        self.url, self.total = url, n_works * epochs
        self.keys = {(e, s) for e in range(epochs) for s in range(n_works)}
        # Made here, so the workers only join (concurrent creation is tested elsewhere).
        WorkQueue(make_works(n_works), num_epochs=epochs, shuffle=True, seed=7, name=QUEUE, url=url,
                  worker="creator").close()
        self.procs = [Proc(url, QUEUE, f"w{i}", tmp / f"w{i}.log", n_works, num_epochs=epochs,
                           item_ms=item_ms, lease=LEASE, heartbeat=HEARTBEAT, poll=0.1)
                      for i in range(n_procs)]

    def received(self) -> int:
        return sum(len(p.received()) for p in self.procs)

    def check_running(self, deadline: float) -> None:
        """Every worker is still running (so what the test does next happens mid-drain), and the
        deadline (``time.monotonic()``) has not passed."""
        for p in self.procs:
            assert p.p.poll() is None, f"{p.worker} exited early (rc {p.p.poll()}):\n{p.stderr()}"
        assert time.monotonic() < deadline, f"only {self.received()} of {self.total} received in time"

    def wait_for(self, fraction: float, timeout: float = 60.0) -> None:
        """Until ``fraction`` of the items were received (see :meth:`check_running`)."""
        deadline = time.monotonic() + timeout
        while self.received() < fraction * self.total:
            self.check_running(deadline)
            time.sleep(0.02)

    def finish(self, timeout: float = 60.0) -> None:
        for p in self.procs:
            rc = p.finish(timeout)
            assert rc == 0, f"{p.worker} exited {rc}; stdout {p.lines}; stderr:\n{p.stderr()}"
            assert any(line.startswith("EXHAUSTED") for line in p.lines), p.lines

    def cleanup(self) -> None:
        for p in self.procs:
            p.cleanup()

    def rejected_acks(self) -> int:
        """Warnings "their completion was rejected" in the workers' stderr: an ack retried after
        its first commit reached the server (the item was already done by this worker)."""
        return sum(p.stderr_path.read_text(errors="replace").count("completion was rejected")
                   for p in self.procs)


def _check_drain(d: Drain, disruptions: list[Disruption]) -> dict[str, int]:
    """The assertions of the module docstring; returns counts for the report."""
    states = query(d.url, "SELECT state, count(*) FROM wq_audit WHERE queue = :q GROUP BY state", q=QUEUE)
    assert dict(states) == {"done": d.total}, states
    audit = query(d.url, "SELECT epoch, seq FROM wq_audit WHERE queue = :q", q=QUEUE)
    assert {(e, s) for e, s in audit} == d.keys

    history = replay(d.url, QUEUE)
    kinds = collections.Counter(x.end for ds in history.values() for x in ds)
    assert set(kinds) <= {"done", "expire"}, kinds
    claims = collections.Counter({key: len(ds) for key, ds in history.items()})
    dones = collections.Counter({key: [x.end for x in ds].count("done") for key, ds in history.items()})
    abandoned = [(key, x.worker, x.claimed_at, x.ended_at) for key, ds in history.items() for x in ds
                 if x.end == "expire"]
    assert set(dones) == d.keys and set(dones.values()) == {1}, "an item done other than once"
    for key, worker, claimed_at, left_at in abandoned:
        assert any(claimed_at < x.end and left_at > x.start for x in disruptions), (
            f"{key}: {worker}'s delivery (claimed {claimed_at}, expired {left_at}) spans no "
            f"disruption {disruptions}")

    got = collections.Counter(key for p in d.procs for e, s, _ in p.received() for key in [(e, s)])
    assert set(got) == d.keys, f"never received: {sorted(d.keys - set(got))[:10]}"
    again = {k for k, n in got.items() if n > 1}
    assert again <= {a[0] for a in abandoned}, f"received twice without an abandoned delivery: {again}"
    assert all(got[k] <= claims[k] for k in got), "a worker received an item more often than it was claimed"
    return {"abandoned": len(abandoned), "received_twice": len(again), "rejected_acks": d.rejected_acks()}


# ---------------------------------------------------------------- a. restarts


@pytest.mark.parametrize(("mode", "outage", "at"), [
    ("fast", 0.0, (0.25, 0.6)),
    ("immediate", 0.0, (0.25, 0.6)),
    ("immediate", 1.5 * LEASE, (0.4,)),
], ids=["fast", "immediate", "immediate-long-outage"])
def test_restart_mid_drain(cluster: PgCluster, url: str, tmp_path: Path, mode: str, outage: float,
                           at: tuple[float, ...]) -> None:
    """``pg_ctl restart -m fast`` (sessions ended, open transactions rolled back) or ``-m
    immediate`` (a crash, then recovery) at 25% and again at 60% of a 3-epoch drain by 4 worker
    processes; or a crash followed by ``1.5 x LEASE`` seconds of downtime at 40%, so that leases
    run out meanwhile and the first worker back may expire its peers' items before they renew
    them (re-deliveries of items held across the outage are allowed). The workers reconnect and
    finish (wq_sql retries for ``busy_timeout``, 30 s), and ``_check_drain`` holds."""
    d = Drain(url, tmp_path)
    disruptions: list[Disruption] = []
    try:
        for fraction in at:
            d.wait_for(fraction)
            start = _now(cluster)
            t0 = time.monotonic()
            cluster.stop(mode)
            time.sleep(outage)
            cluster.start()
            what = f"-m {mode}, down {time.monotonic() - t0:.2f}s"
            disruptions.append(Disruption(what, start, _now(cluster)))
        assert d.received() < d.total, "the drain ended before the last restart took effect"
        d.finish()
    finally:
        d.cleanup()
    summary = _check_drain(d, disruptions)
    print("restart:", [x.what for x in disruptions], summary)


# ---------------------------------------------------------------- b. terminated backends


def test_terminate_worker_backends_repeatedly(cluster: PgCluster, url: str, tmp_path: Path) -> None:
    """Every 0.1-0.3 s, ``pg_terminate_backend`` on a random non-empty subset of the workers'
    sessions (``application_name = 'wq_sql'``: claims and heartbeats) until 85% of the items were
    received (items of 80 ms here, so the drain lasts); at least 6 rounds must have ended a
    session. Then ``_check_drain``."""
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    d = Drain(url, tmp_path, item_ms=80)
    disruptions: list[Disruption] = []
    ended = 0
    try:
        d.wait_for(0.05)
        deadline = time.monotonic() + 60
        while d.received() < 0.85 * d.total:
            d.check_running(deadline)
            time.sleep(rng.uniform(0.1, 0.3))
            pids = [r[0] for r in cluster.sql(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'wq_sql' AND datname = :db",
                db=_db(url))]
            if not pids:
                continue
            victims = rng.sample(pids, rng.randint(1, len(pids)))
            start = _now(cluster)
            n = sum(bool(r[0]) for r in cluster.sql(
                "SELECT pg_terminate_backend(pid) FROM unnest(CAST(:p AS int[])) AS pid", p=victims))
            disruptions.append(Disruption(f"terminated {n}", start, _now(cluster)))
            ended += n > 0
        d.finish()
    finally:
        d.cleanup()
    assert ended >= 6, f"only {ended} rounds ended a session before the drain was 85% through"
    summary = _check_drain(d, disruptions)
    print(f"pg_terminate_backend: {ended} rounds, {sum(int(x.what.split()[1]) for x in disruptions)} "
          f"sessions ended;", summary)


# ---------------------------------------------------------------- c. idle in transaction


IDLE_IN_TX_SQL = ("SELECT pid, state, now() - xact_start, query FROM pg_stat_activity "
                  "WHERE application_name = 'wq_sql' AND datname = :db AND state LIKE 'idle in transaction%' "
                  "AND now() - xact_start > make_interval(secs => :secs)")


def test_no_transaction_held_across_items(cluster: PgCluster, url: str, tmp_path: Path) -> None:
    """4 workers, each item a 500 ms sleep: sampling ``pg_stat_activity`` every 20 ms finds no
    ``wq_sql`` session idle in a transaction older than 250 ms (a transaction held across an item
    would be, in nearly every sample). First, the sampler must catch a planted one."""
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg2://", 1),
                              connect_args={"application_name": "wq_sql"})
    try:
        with engine.connect() as planted, planted.begin():
            planted.execute(sa.text("SELECT 1"))
            time.sleep(0.4)
            seen = cluster.sql(IDLE_IN_TX_SQL, db=_db(url), secs=0.25)
            assert len(seen) == 1, f"the sampler missed a planted idle-in-transaction session: {seen}"
    finally:
        engine.dispose()

    d = Drain(url, tmp_path, n_works=32, epochs=1, item_ms=500)
    held: list[Any] = []
    samples = 0
    try:
        d.wait_for(0.1)
        deadline = time.monotonic() + 60
        while any(p.p.poll() is None for p in d.procs):
            assert time.monotonic() < deadline, "the workers did not finish within 60 s"
            held += cluster.sql(IDLE_IN_TX_SQL, db=_db(url), secs=0.25)
            samples += 1
            time.sleep(0.02)
        d.finish()
    finally:
        d.cleanup()
    assert samples >= 20, samples
    assert held == [], f"{len(held)} samples of wq_sql sessions idle in a transaction > 250 ms: {held[:5]}"
    left = cluster.sql("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'wq_sql' "
                       "AND datname = :db", db=_db(url))
    assert left == [(0,)], f"sessions left after every worker exited: {left}"
    _check_drain(d, [])
    print(f"idle in transaction: {samples} samples, none held")


# ---------------------------------------------------------------- d. foreign transactions


def _foreign(url: str) -> sa.Engine:
    return sa.create_engine(url.replace("postgresql://", "postgresql+psycopg2://", 1),
                            connect_args={"application_name": "foreign"})


def _takes(wq: Any, n: int, on_take: Optional[Callable[[Any], None]] = None) -> list[float]:
    """Seconds per ``take()`` for ``n`` takes (each also acks the previous item)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        item = wq.take(timeout=0)
        out.append(time.perf_counter() - t0)
        if on_take:
            on_take(item)
    return out


def test_foreign_row_lock_and_old_snapshot(url: str) -> None:
    """A foreign session holds a REPEATABLE READ snapshot from before the drain (and with it an
    ACCESS SHARE lock on wq_items), another holds ``SELECT ... FOR UPDATE`` on the pending item
    (0, 5). One worker takes the other 199 items without waiting (SKIP LOCKED; statement_timeout
    5 s, so a claim blocked by either session fails the test),
    then ``take(timeout=0)`` says ``QueueEmpty`` (the locked item is pending but not claimable);
    once the lock holder commits, the next take hands out (0, 5), then ``QueueExhausted``, and
    every item is done exactly once."""
    from wq_sql import QueueEmpty, QueueExhausted, WorkQueue
    from wq_sql.store.engine import make_engine, resolve_url

    n = 200
    # A claim blocked by a lock fails after 5 s (QueryCanceled) instead of the default 60 s.
    engine = make_engine(resolve_url(url), statement_timeout=5.0)
    wq = WorkQueue(make_works(n), num_epochs=1, shuffle=False, name=QUEUE, url=url, worker="d0",
                   engine=engine)
    snap_eng, lock_eng = _foreign(url), _foreign(url)
    try:
        with snap_eng.connect() as snap, lock_eng.connect() as locker:
            snap.execute(sa.text("BEGIN ISOLATION LEVEL REPEATABLE READ"))
            assert snap.execute(sa.text("SELECT count(*) FROM wq_items")).scalar() == n
            # OF i: a lock on the wq_queues row would block a worker's first acknowledging round
            # of each epoch (see docs/design.md).
            locked = locker.execute(sa.text(
                "SELECT i.id FROM wq_items i JOIN wq_queues q ON q.id = i.queue_id "
                "WHERE q.name = :q AND i.epoch = 0 AND i.seq = 5 AND i.state = 'pending' FOR UPDATE OF i"),
                {"q": QUEUE}).all()
            assert len(locked) == 1
            times = _takes(wq, n - 1)
            assert max(times) < 5.0, f"a claim waited {max(times):.1f}s"
            with pytest.raises(QueueEmpty):
                wq.take(timeout=0)
            pending = query(url, "SELECT epoch, seq FROM wq_audit WHERE queue = :q AND state = 'pending'",
                            q=QUEUE)
            assert pending == [(0, 5)], pending
            locker.commit()
            last = wq.take(timeout=5)
            assert (last.epoch, last.seq) == (0, 5)
            with pytest.raises(QueueExhausted):
                wq.take(timeout=5)
            snap.rollback()
    finally:
        wq.close()
        engine.dispose()
        snap_eng.dispose()
        lock_eng.dispose()
    done = query(url, "SELECT count(*), count(DISTINCT (epoch, seq)) FROM wq_audit "
                      "WHERE queue = :q AND state = 'done'", q=QUEUE)
    assert done == [(n, n)], done
    dones = query(url, "SELECT count(*) FROM wq_history WHERE queue = :q AND kind = 'done'", q=QUEUE)
    assert dones == [(n,)], dones


def test_a_foreign_lock_on_the_queue_row_blocks_only_joining_and_a_first_acknowledgement(url: str) -> None:
    """A foreign ``SELECT ... FOR UPDATE`` on the queue's ``wq_queues`` row conflicts with the
    ``KEY SHARE`` of a foreign-key check. Since migration 0009 the hot path checks none on
    Postgres: a worker past its first acknowledgement of the epoch goes on taking (each take
    acknowledges the previous item, with its history row) without waiting; a worker's first
    acknowledgement (its counter row for the epoch is inserted) waits, and fails after
    ``statement_timeout``; once the lock goes, it goes through, and nothing is lost."""
    from wq_sql import QueueExhausted, WorkQueue
    from wq_sql.store.engine import make_engine, resolve_url

    n = 40
    engines = [make_engine(resolve_url(url), statement_timeout=2.0) for _ in range(2)]
    a = WorkQueue(make_works(n), num_epochs=1, shuffle=False, name=QUEUE, url=url, worker="a",
                  lease_ahead=1, claim_ahead=False, engine=engines[0])
    b = WorkQueue.attach(QUEUE, url=url, worker="b", lease_ahead=1, claim_ahead=False, engine=engines[1])
    lock_eng = _foreign(url)
    try:
        a.take()
        a.take()  # acknowledges the first: a's counter row exists
        b.take()
        with lock_eng.connect() as locker:
            locked = locker.execute(sa.text("SELECT id FROM wq_queues WHERE name = :q FOR UPDATE"),
                                    {"q": QUEUE}).all()
            assert len(locked) == 1
            times = _takes(a, 10)
            assert max(times) < 1.0, f"an acknowledging take waited {max(times):.1f}s behind the lock"
            t0 = time.perf_counter()
            with pytest.raises(sa.exc.OperationalError, match="statement timeout"):  # not retried
                b.take(timeout=0)
            assert time.perf_counter() - t0 >= 1.5
            locker.rollback()
        a.close()  # acknowledges its last item: b drains the rest to the end
        got = 0
        with pytest.raises(QueueExhausted):
            while True:
                b.take(timeout=5)
                got += 1
        assert got > 0
    finally:
        a.close()
        b.close()
        for e in engines:
            e.dispose()
        lock_eng.dispose()
    done = query(url, "SELECT count(*), count(DISTINCT (epoch, seq)) FROM wq_audit "
                      "WHERE queue = :q AND state = 'done'", q=QUEUE)
    assert done == [(n, n)], done


@dataclass
class LatencyRun:
    label: str
    times: list[float]
    dead_tuples: int

    def pct(self, q: float) -> float:
        s = sorted(self.times)
        return s[min(len(s) - 1, int(q * len(s)))]

    def line(self) -> str:
        return (f"{self.label:>13}: {len(self.times)} takes, p50 {self.pct(0.5) * 1e3:.2f} ms, "
                f"p99 {self.pct(0.99) * 1e3:.2f} ms, max {max(self.times) * 1e3:.1f} ms, "
                f"mean {statistics.fmean(self.times) * 1e3:.2f} ms, n_dead_tup {self.dead_tuples}")


def measure_old_snapshot(pg: PgCluster, claims: int, chunk: int = 250) -> tuple[LatencyRun, LatencyRun]:
    """Claim latency (``take()`` at lease-ahead 1, one worker) over ``claims`` items in two
    databases of one cluster, drained in alternating chunks: in one, a foreign session holds a
    REPEATABLE READ snapshot taken before the first claim (so no dead tuple of the drain can be
    pruned or vacuumed); in the other nothing does. Horizons are per database, so the snapshot
    does not slow the reference."""
    from wq_sql import WorkQueue

    urls = {"no snapshot": fresh_url(pg), "old snapshot": fresh_url(pg)}
    queues = {k: WorkQueue(make_works(claims), num_epochs=1, shuffle=False, name="lat", url=u,
                           worker="lat") for k, u in urls.items()}
    times: dict[str, list[float]] = {k: [] for k in urls}
    eng = _foreign(urls["old snapshot"])
    try:
        with eng.connect() as snap:
            snap.execute(sa.text("BEGIN ISOLATION LEVEL REPEATABLE READ"))
            snap.execute(sa.text("SELECT count(*) FROM wq_items")).scalar()
            left = claims
            while left > 0:
                k = min(chunk, left)
                for label, wq in queues.items():
                    times[label] += _takes(wq, k)
                left -= k
            dead = {label: pg.sql("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'wq_items'",
                                  _db(u))[0][0] for label, u in urls.items()}
            snap.rollback()
    finally:
        for wq in queues.values():
            wq.close()
        eng.dispose()
    return (LatencyRun("no snapshot", times["no snapshot"], dead["no snapshot"]),
            LatencyRun("old snapshot", times["old snapshot"], dead["old snapshot"]))


def _buffers(url: str, sql: str) -> int:
    """Shared buffers one statement touches (``EXPLAIN (ANALYZE, BUFFERS)``, rolled back)."""
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg2://", 1))
    try:
        with engine.connect() as c:
            plan = [r[0] for r in c.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) " + sql)]
            c.rollback()
    finally:
        engine.dispose()
    top = next(line for line in plan if "Buffers:" in line)
    return sum(int(part.split("=")[1]) for part in top.split(":", 1)[1].split() if "=" in part)


def measure_snapshot_buffers(pg: PgCluster, claims: int, steps: int = 4, after: int = 4000) -> None:
    """Why claims slow down under an old snapshot: buffers read by the ack round's tally upsert
    and by a claim scanning from the start, every ``claims / steps`` claims with the snapshot
    held, then ``after`` claims after it ended. Prints one line per step."""
    from wq_sql import WorkQueue

    url = fresh_url(pg)
    wq = WorkQueue(make_works(claims + after), num_epochs=1, shuffle=False, name="buf", url=url,
                   worker="buf")
    (qid, wid), = query(url, "SELECT q.id, w.id FROM wq_queues q JOIN wq_workers w ON w.queue_id = q.id "
                             "WHERE q.name = 'buf' AND w.name = 'buf'")
    tally = ("INSERT INTO wq_tallies AS t (queue_id, epoch, worker_id, n_done) "
             f"VALUES ({qid}, 0, {wid}, 1) ON CONFLICT (queue_id, epoch, worker_id) "
             "DO UPDATE SET n_done = t.n_done + excluded.n_done")
    scan = (f"SELECT id FROM wq_items WHERE queue_id = {qid} AND state = 'pending' "
            "ORDER BY epoch, seq LIMIT 1 FOR UPDATE SKIP LOCKED")

    def report(label: str, t: list[float]) -> None:
        p50 = statistics.median(t) * 1e3 if t else float("nan")
        print(f"{label:>34}: tally upsert {_buffers(url, tally):5d} buffers, scan from the start "
              f"{_buffers(url, scan):5d} buffers, take() p50 {p50:.2f} ms", flush=True)

    report("before", _takes(wq, 500))
    eng = _foreign(url)
    done = 500
    try:
        with eng.connect() as snap:
            snap.execute(sa.text("BEGIN ISOLATION LEVEL REPEATABLE READ"))
            snap.execute(sa.text("SELECT count(*) FROM wq_items")).scalar()
            for _ in range(steps):
                k = (claims - 500) // steps
                t = _takes(wq, k)
                done += k
                report(f"snapshot held, {done} claims", t)
            snap.rollback()
        for _ in range(4):
            t = _takes(wq, after // 4)
            report(f"snapshot ended, +{after // 4} claims", t)
    finally:
        wq.close()
        eng.dispose()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="claim latency with and without an old snapshot")
    ap.add_argument("--claims", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--buffers", action="store_true", help="measure_snapshot_buffers instead")
    a = ap.parse_args()
    with PgCluster(SETTINGS) as pg_:
        if a.buffers:
            measure_snapshot_buffers(pg_, a.claims)
            sys.exit(0)
        for run in range(a.runs):
            p_, s_ = measure_old_snapshot(pg_, a.claims)
            print(f"run {run + 1}\n{p_.line()}\n{s_.line()}\n  ratio p50 {s_.pct(0.5) / p_.pct(0.5):.2f}, "
                  f"p99 {s_.pct(0.99) / p_.pct(0.99):.2f}, mean "
                  f"{statistics.fmean(s_.times) / statistics.fmean(p_.times):.2f}", flush=True)
