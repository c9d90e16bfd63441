"""Failover: a primary replaced by its standby while workers drain a queue.

* Multi-host URLs (``postgresql://u@h1:p1,h2:p2/db?target_session_attrs=read-write``, libpq's
  way to name a primary and its standbys) reach SQLAlchemy in the form it reads, and skip a dead
  host.
* An acknowledgement retried after its first commit went through (the reply lost to a failover)
  is accepted, not reported as a lost lease: explicit ``complete()`` and the ack carried by the
  next claim, on both backends.
* A primary that turns read-only under the workers (what a demoted primary looks like to a
  pooled connection: SQLSTATE 25006), on a throwaway cluster: 8 worker processes ride it out, a
  new worker waits for a primary, a URL that only reaches a read-only server says so.
* The real thing, on a Patroni + etcd pair (``scripts/ha_cluster.py``): the primary's postmaster
  SIGKILLed mid-drain, a planned switchover, the synchronous standby lost. Each is a 3-epoch
  drain by 8 worker processes, half of them acknowledging explicitly; afterwards
  ``test_chaos_pg``'s checks hold (every ``(epoch, seq)`` done exactly once, every abandoned
  delivery open across the disruption, what the workers received agrees), every explicit
  ``complete()`` that returned has its ``done`` event by that worker (no acknowledged item lost),
  and no worker printed a traceback. ``bench/failover.py`` (``make failover``) runs the same
  drills longer and reports the times.

The Patroni tests need the ``patroni`` and ``etcd-server`` packages: the fixture installs them
with apt-get (as root) when missing. Under ``$CI`` a pair that cannot be made fails the module;
elsewhere it skips.
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from pgcluster import PgCluster  # noqa: E402
from test_chaos_pg import (  # noqa: E402  (the chaos drain and its checks, reused)
    HEARTBEAT,
    LEASE,
    QUEUE,
    Disruption,
    Drain,
    _check_drain,
    cluster,  # noqa: F401  (the throwaway cluster fixture)
    fresh_url,
)
from worker_proc import Proc, make_works, query, query_commit  # noqa: E402

# A drain of about 3 s of work on 8 workers: the faults land at 30% and outlast the rest of it.
N_PROCS, N_WORKS, EPOCHS, ITEM_MS = 8, 80, 3, 100.0


def _dead_port() -> int:
    """A port of 127.0.0.1 nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _multihost(url: str, *first: int) -> str:
    """``url`` (``postgresql://postgres@127.0.0.1:P/db``) with the ports ``first`` listed before
    its own, and ``target_session_attrs=read-write``."""
    head, db = url.rsplit("/", 1)
    user_host, port = head.rsplit(":", 1)
    user = user_host.rsplit("@", 1)[0]
    hosts = ",".join(f"127.0.0.1:{p}" for p in (*first, int(port)))
    return f"{user}@{hosts}/{db}?target_session_attrs=read-write&connect_timeout=2"


# ---------------------------------------------------------------- URLs


@pytest.mark.parametrize(("given", "host", "port", "extra"), [
    ("postgresql://postgres@127.0.0.1:5432,127.0.0.1:5433/db?target_session_attrs=read-write",
     "127.0.0.1,127.0.0.1", "5432,5433", {"target_session_attrs": "read-write"}),
    ("postgresql://u:p%40ss@h1,h2:6000/db", "h1,h2", ",6000", {"password": "p@ss"}),
    ("postgres://u@[::1]:5432,db2/db?sslmode=require", "::1,db2", "5432,", {"sslmode": "require"}),
    ("postgresql+psycopg2://u@a,b,c/db", "a,b,c", ",,", {}),  # libpq: empty = default port
])
def test_multihost_url_reaches_the_driver(given: str, host: str, port: Optional[str],
                                          extra: dict[str, str]) -> None:
    from wq_sql.store.engine import make_engine, resolve_url
    from wq_sql.store.redact import safe_url

    url = resolve_url(given)
    engine = make_engine(url)
    try:
        _, kw = engine.dialect.create_connect_args(url)
    finally:
        engine.dispose()
    assert (kw["host"], kw.get("port"), kw["dbname"]) == (host, port, "db")
    assert {k: kw[k] for k in extra} == extra
    assert "p@ss" not in safe_url(url) and "p%40ss" not in safe_url(url)


@pytest.mark.parametrize(("given", "says"), [
    ("postgresql://u@h1:5432,:5433/db", "cannot read host ':5433'"),
    ("postgresql://u@h1:x,h2/db", "cannot read host 'h1:x'"),
    ("postgresql://u@h1,h2/db?host=h3", "drop host= and port="),
])
def test_multihost_url_mistakes_are_named(given: str, says: str) -> None:
    from wq_sql.errors import InvalidInput
    from wq_sql.store.engine import resolve_url

    with pytest.raises(InvalidInput, match=says.replace("?", r"\?")):
        resolve_url(given)


def test_multihost_url_skips_a_dead_host(db_url: str, backend: str) -> None:
    """The first host refuses connections; libpq goes on to the second, and wq_sql works."""
    if backend != "postgresql":
        pytest.skip("a Postgres URL")
    from wq_sql import QueueExhausted, WorkQueue

    url = _multihost(db_url, _dead_port())
    with WorkQueue(make_works(5), shuffle=False, name="multi", url=url, worker="m") as wq:
        got = [str(wq.take()) for _ in range(5)]
        with pytest.raises(QueueExhausted):
            wq.take()
    assert got == make_works(5)


def test_first_transaction_whose_connection_is_cut_is_retried(db_url: str, backend: str) -> None:
    """A worker starting while the server restarts or fails over: its very first connection is
    made, then ended by the server (here ``pg_terminate_backend``, as a failover ends it). That
    is not a wrong URL: wq_sql retries instead of raising at once."""
    if backend != "postgresql":
        pytest.skip("a Postgres connection")
    import sqlalchemy as sa

    from wq_sql import WorkQueue
    from wq_sql.store.engine import make_engine, resolve_url

    engine = make_engine(resolve_url(db_url), pool_size=3)
    cut: list[int] = []

    @sa.event.listens_for(engine, "checkout")
    def _cut_first(dbapi_conn: Any, *_: Any) -> None:
        if not cut:
            cut.append(dbapi_conn.get_backend_pid())
            query(db_url, "SELECT pg_terminate_backend(:p)", p=cut[0])

    try:
        with WorkQueue(make_works(3), shuffle=False, name="cut", url=db_url, worker="c", engine=engine) as wq:
            assert str(wq.take()) == make_works(3)[0]
    finally:
        engine.dispose()
    assert len(cut) == 1


# ---------------------------------------------------------------- an ack whose reply was lost


def _done_behind_its_back(url: str, item: Any) -> None:
    """What the first attempt of an acknowledgement did before its reply was lost: the row is
    done with the item's token (its events and tallies are not what this checks)."""
    query_commit(url, "UPDATE wq_items SET state = 'done', lease_until = NULL WHERE id IN "
                      "(SELECT id FROM wq_items WHERE epoch = :e AND seq = :s AND token = :t)",
                 e=item.epoch, s=item.seq, t=item.token)


def test_retried_complete_after_its_commit_went_through(db_url: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """``complete()``'s first commit reached the database but its reply was lost, so the retry
    finds the item done already, with this delivery's token: accepted, no ``LeaseLost``. An
    implicit ack (sent with the next claim) likewise logs no rejection. An item done under
    another token is still refused (``test_crash`` covers that fence)."""
    from wq_sql import WorkQueue

    caplog.set_level(logging.WARNING, logger="wq_sql")
    with WorkQueue(make_works(4), shuffle=False, name="retry", url=db_url, worker="x",
                   auto_complete=False) as wq:
        a = wq.take()
        _done_behind_its_back(db_url, a)
        wq.complete(a)  # raised LeaseLost before
    with WorkQueue(make_works(4), shuffle=False, name="retry", url=db_url, worker="y") as wq:
        b = wq.take()
        _done_behind_its_back(db_url, b)
        wq.take()  # acknowledges b with the claim round
    assert "completion was rejected" not in caplog.text, caplog.text
    states = query(db_url, "SELECT seq, state FROM wq_audit WHERE queue = 'retry' ORDER BY seq")
    assert [tuple(r) for r in states] == [(0, "done"), (1, "done"), (2, "done"), (3, "pending")]


# ---------------------------------------------------------------- a primary turned read-only


def _read_only(pg: PgCluster, on: bool) -> None:
    """Every new transaction on the server read-only (``default_transaction_read_only``, applied
    to open sessions by the reload), or back to normal. The admin's own session overrides it."""
    import psycopg2

    conn = psycopg2.connect(host="127.0.0.1", port=pg.port, user="postgres", dbname="postgres",
                            options="-c default_transaction_read_only=off")
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"ALTER SYSTEM SET default_transaction_read_only = {'on' if on else 'DEFAULT'}")
            cur.execute("SELECT pg_reload_conf()")
    finally:
        conn.close()


def _now(url: str) -> dt.datetime:
    return query(url, "SELECT clock_timestamp()")[0][0]  # type: ignore[no-any-return]


class AckDrain(Drain):
    """:class:`test_chaos_pg.Drain` with ``n_procs`` workers, every odd one acknowledging with an
    explicit ``complete()`` (``--ack-log``)."""

    def __init__(self, url: str, tmp: Path, *, n_works: int = N_WORKS, epochs: int = EPOCHS,
                 item_ms: float = ITEM_MS, n_procs: int = N_PROCS, lease: float = LEASE,
                 heartbeat: float = HEARTBEAT) -> None:
        from wq_sql import WorkQueue

        self.url, self.total = url, n_works * epochs
        self.keys = {(e, s) for e in range(epochs) for s in range(n_works)}
        WorkQueue(make_works(n_works), num_epochs=epochs, shuffle=True, seed=7, name=QUEUE, url=url,
                  worker="creator").close()
        self.ack_logs = {f"w{i}": tmp / f"w{i}.acks" for i in range(1, n_procs, 2)}
        self.procs = [Proc(url, QUEUE, f"w{i}", tmp / f"w{i}.log", n_works, num_epochs=epochs,
                           item_ms=item_ms, lease=lease, heartbeat=heartbeat, poll=0.1,
                           ack_log=self.ack_logs.get(f"w{i}"))
                      for i in range(n_procs)]

    def progress(self) -> dict[str, int]:
        return {p.worker: len(p.received()) for p in self.procs}


def check_acks(d: AckDrain) -> int:
    """Every ``complete()`` that returned (a line of an ack log) has its ``done`` event by that
    worker: no acknowledged item was lost. No worker printed a traceback. Returns the number of
    explicit acknowledgements checked."""
    done_by = dict(((e, s), w) for e, s, w in query(
        d.url, "SELECT epoch, seq, worker FROM wq_history WHERE queue = :q AND kind = 'done'", q=QUEUE))
    n = 0
    for worker, path in d.ack_logs.items():
        for line in path.read_text().splitlines():
            e, s = map(int, line.split())
            by = done_by.get((e, s))
            assert by == worker, f"{worker} acknowledged {(e, s)}, done by {by}"
            n += 1
    for p in d.procs:
        err = p.stderr_path.read_text(errors="replace")
        assert "Traceback" not in err, f"{p.worker}:\n{err}"
    return n


def warnings_of(d: Drain) -> collections.Counter[str]:
    """wq_sql's WARNING lines in the workers' stderr, counted by their text (without the queue
    name) up to the first parenthesis or digit: what kind of event, not which."""
    out: collections.Counter[str] = collections.Counter()
    for p in d.procs:
        for line in p.stderr_path.read_text(errors="replace").splitlines():
            if " WARNING " in line:
                text = re.sub(r"^queue '[^']*': ", "", line.split(" WARNING ", 1)[1])
                out[re.split(r"[(\d]", text)[0].strip()[:90]] += 1
    return out


def test_primary_turned_read_only_mid_drain(cluster: PgCluster, tmp_path: Path) -> None:  # noqa: F811
    """At 30% of the drain the server turns read-only for 2 s: open sessions get SQLSTATE 25006,
    reconnects through the multi-host URL find no writable host ("session is read-only"). The
    8 workers retry (dropping their pooled connections) and finish; the checks hold."""
    url = _multihost(fresh_url(cluster), _dead_port())
    d = AckDrain(url, tmp_path)
    try:
        d.wait_for(0.3)
        start = _now(url)
        _read_only(cluster, True)
        time.sleep(2.0)
        _read_only(cluster, False)
        end = _now(url)
        assert d.received() < d.total, "the drain ended before the server was writable again"
        d.finish()
    finally:
        d.cleanup()
        _read_only(cluster, False)
    summary = _check_drain(d, [Disruption("read-only for 2 s", start, end)])
    acks = check_acks(d)
    seen = warnings_of(d)
    assert any("database connection lost" in w for w in seen), seen
    print("read-only primary:", summary, "explicit acks", acks, dict(seen))


def test_new_worker_waits_for_a_primary(cluster: PgCluster) -> None:  # noqa: F811
    """While no host of the URL takes writes, a new ``WorkQueue`` waits (a failover in progress)
    and starts once one does; with a short ``busy_timeout`` it raises ``DatabaseUnavailable``
    naming the cause. A URL that reaches only the read-only server says that it is read-only."""
    from wq_sql import DatabaseUnavailable, WorkQueue

    plain = fresh_url(cluster)
    url = _multihost(plain, _dead_port())
    _read_only(cluster, True)
    try:
        with pytest.raises(DatabaseUnavailable, match="no host in the URL is a primary"):
            WorkQueue(make_works(3), name="late", url=url, worker="a", busy_timeout=1.5)
        with pytest.raises(DatabaseUnavailable, match="is read-only"):
            WorkQueue(make_works(3), name="late", url=plain, worker="a", busy_timeout=1.5)
        timer = threading.Timer(2.0, _read_only, (cluster, False))
        timer.start()
        t0 = time.monotonic()
        with WorkQueue(make_works(3), name="late", url=url, worker="a", busy_timeout=30) as wq:
            waited = time.monotonic() - t0
            wq.take()
        timer.join()
    finally:
        _read_only(cluster, False)
    assert waited >= 1.5, waited


# ---------------------------------------------------------------- Patroni: the real thing


@pytest.fixture(scope="module")
def ha() -> Iterator[Any]:
    from ha_cluster import HACluster, HAClusterError

    pair: Optional[HACluster] = None
    try:
        pair = HACluster()
        pair.start()
    except (HAClusterError, OSError) as e:
        msg = f"cannot make a Patroni pair: {e}"
        if os.environ.get("CI"):
            pytest.fail(msg + "\nthe failover tests are required in CI", pytrace=False)
        pytest.skip(msg)
    try:
        yield pair
    finally:
        left = pair.close()
        assert left == [], f"processes left after the pair's teardown: {left}"


def ha_url(ha: Any) -> str:
    import uuid

    import wq_sql

    name = f"fo_{uuid.uuid4().hex[:10]}"
    ha.psql(ha.leader(), f'CREATE DATABASE "{name}"')
    # libpq tries the hosts in order and stops at a standby that has not replayed the CREATE
    # yet ("database does not exist" ends the attempt before target_session_attrs is checked).
    deadline = time.monotonic() + 30
    while not all(ha.psql(n, f"SELECT 1 FROM pg_database WHERE datname = '{name}'") for n in ha.names):
        assert time.monotonic() < deadline, f"database {name} not replayed on every node within 30 s"
        time.sleep(0.05)
    url: str = ha.url(name)
    wq_sql.upgrade(url)
    query_commit(url, "CREATE TABLE failover_probe (at timestamptz)")
    return url


def _until_written(url: str, timeout: float) -> dt.datetime:
    """The database clock once a write transaction through ``url`` commits again (a row
    inserted into ``failover_probe``: its commit waits for the synchronous standby)."""
    import sqlalchemy as sa

    from wq_sql.store.engine import resolve_url

    engine = sa.create_engine(resolve_url(url), poolclass=sa.pool.NullPool)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                with engine.begin() as c:
                    return c.exec_driver_sql(  # type: ignore[no-any-return]
                        "INSERT INTO failover_probe VALUES (clock_timestamp()) RETURNING at").one()[0]
            except sa.exc.DBAPIError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        engine.dispose()


def _resumed(d: AckDrain, before: dict[str, int], timeout: float) -> float:
    """Wait until every worker still running received an item more than ``before``; returns
    that moment (``time.monotonic()``)."""
    t0 = time.monotonic()
    waiting = set(before)
    while waiting:
        now = d.progress()
        waiting = {w for w in waiting if now[w] <= before[w] and
                   next(p for p in d.procs if p.worker == w).p.poll() is None}
        assert time.monotonic() - t0 < timeout, f"workers {waiting} received nothing for {timeout}s"
        time.sleep(0.02)
    return time.monotonic()


class Progress:
    """Samples the items received (all workers) every 10 ms from its start; :meth:`stop` returns
    the longest time nobody received an item (the workers' stall across the fault)."""

    def __init__(self, d: AckDrain) -> None:
        self._d, self._stop = d, threading.Event()
        self.longest = 0.0
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        last_n, last_t = self._d.received(), time.monotonic()
        while not self._stop.wait(0.01):
            n, t = self._d.received(), time.monotonic()
            if n != last_n:
                last_n, last_t = n, t
            self.longest = max(self.longest, t - last_t)

    def stop(self) -> float:
        self._stop.set()
        self._t.join(5)
        return self.longest


def drill(ha: Any, tmp_path: Path, faults: list[tuple[str, float]], *, n_works: int = N_WORKS,
          epochs: int = EPOCHS, item_ms: float = ITEM_MS, n_procs: int = N_PROCS,
          timeout: float = 120.0) -> dict[str, Any]:
    """One drain by ``n_procs`` workers with ``faults`` injected, each ``(kind, fraction)``: at
    that fraction of the items received (and once the pair is healthy again after the previous
    fault), ``kill`` SIGKILLs the primary's postmaster, ``switchover`` runs ``patronictl
    switchover``, ``standby`` SIGKILLs the synchronous standby's node (started again right after:
    it rejoins during the drain). Then the checks of the module docstring. Returns what it
    measured, per fault: seconds from the fault until a write commits through the URL, until
    every worker received an item again, and the longest time nobody received one."""
    url = ha_url(ha)
    d = AckDrain(url, tmp_path, n_works=n_works, epochs=epochs, item_ms=item_ms, n_procs=n_procs)
    done: list[dict[str, Any]] = []
    disruptions: list[Disruption] = []
    try:
        for fault, at in faults:
            leader = ha.wait_healthy(timeout)
            standby = next(n for n in ha.names if n != leader)
            d.wait_for(at, timeout=timeout + n_works * epochs * item_ms / 1e3)
            before = d.progress()
            start = _now(url)
            sampler = Progress(d)
            t0 = time.monotonic()
            if fault == "kill":
                ha.kill_postmaster(leader)
            elif fault == "switchover":
                ha.switchover(standby)  # returns once patronictl saw the new leader
            elif fault == "standby":
                ha.kill_node(standby)
            else:
                raise ValueError(f"unknown fault {fault!r}")
            end = _until_written(url, timeout)
            out: dict[str, Any] = {"fault": fault, "at": at,
                                   "fault_to_write_s": round(time.monotonic() - t0, 2)}
            assert d.received() < d.total, f"the drain ended before the {fault} took effect"
            out["all_workers_resumed_s"] = round(_resumed(d, before, timeout) - t0, 2)
            out["longest_stall_s"] = round(sampler.stop(), 2)
            now_leader = ha.leader()
            out["leader"] = f"{leader} -> {now_leader}"
            if fault == "standby":
                assert now_leader == leader, "losing the standby moved the primary"
                ha.start_node(standby)
            else:
                assert now_leader == standby, f"{standby} was not promoted: {now_leader}"
            disruptions.append(Disruption(fault, start, end))
            done.append(out)
        d.finish(timeout=timeout + n_works * epochs * item_ms / 1e3)
    finally:
        d.cleanup()
    summary: dict[str, Any] = {"faults": done, "items": d.total, "procs": n_procs}
    summary.update(_check_drain(d, disruptions))
    summary["explicit_acks"] = check_acks(d)
    summary["warnings"] = dict(warnings_of(d))
    ha.wait_healthy(timeout)
    return summary


def test_primary_postmaster_killed_mid_drain(ha: Any, tmp_path: Path) -> None:
    """SIGKILL of the primary's postmaster at 30% of the drain: Patroni
    (``primary_start_timeout: 0``) hands the leader key to the synchronous standby, which
    promotes; the workers reconnect through the multi-host URL and finish."""
    out = drill(ha, tmp_path, [("kill", 0.3)])
    print("failover drill:", out)
    assert any("database connection lost" in w for w in out["warnings"]), out


def test_switchover_mid_drain(ha: Any, tmp_path: Path) -> None:
    """``patronictl switchover`` at 30% of the drain: the primary shuts down (sessions ended),
    the standby promotes, the old primary follows it. A longer drain than the others': the
    switchover itself (patronictl, a clean shutdown) took over 2 s under a loaded suite, and the
    default drain's remaining 70% (2.1 s) once ended before it (`drain ended before the
    switchover took effect`)."""
    out = drill(ha, tmp_path, [("switchover", 0.3)], n_works=3 * N_WORKS)
    print("switchover drill:", out)


def test_standby_lost_mid_drain(ha: Any, tmp_path: Path) -> None:
    """The synchronous standby's Patroni and PostgreSQL SIGKILLed at 30%: commits wait until
    Patroni drops it from ``synchronous_standby_names`` (not strict), then the primary serves
    alone; the standby is started again afterwards and rejoins."""
    out = drill(ha, tmp_path, [("standby", 0.3)])
    print("lost standby drill:", out)
