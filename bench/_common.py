"""Shared helpers for the benchmarks: scratch databases, cloning a queue server-side, machine
details, medians and percentiles.

Every benchmark measures its reference in the same run and reports ratios: the machines here are
shared and noisy, so absolute figures vary from run to run; ratios much less.

Postgres: ``--pg`` (default ``$WQ_SQL_BENCH_PG``, else ``postgresql://postgres@127.0.0.1:5432/postgres``)
is the admin URL; each benchmark creates its own ``wq_bench_*`` database there and drops it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
# ``$WQ_SQL_BENCH_SRC``: import wq_sql from another tree (e.g. ``git archive HEAD wq_sql migrations |
# tar -x -C /tmp/wq_head``), to measure a fixed revision while the checkout is being edited.
SRC = Path(os.environ.get("WQ_SQL_BENCH_SRC") or ROOT)
sys.path.insert(0, str(SRC))

from wq_sql.store.engine import resolve_url  # noqa: E402

PG_ADMIN = os.environ.get("WQ_SQL_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
# Issue 16's goals for wq_sql take() / the raw driver, one process, by (backend, lease_ahead)
# (claim_throughput.py's verdicts, headline.py's table).
CLAIM_GOALS = {("sqlite", 32): 0.70, ("sqlite", 1): 0.60, ("postgresql", 32): 0.85, ("postgresql", 1): 0.70}


def pg_url(admin: str, db: str) -> str:
    return resolve_url(admin).set(database=db).render_as_string(hide_password=False)


@contextlib.contextmanager
def scratch_pg(admin: str = PG_ADMIN, tag: str = "x") -> Iterator[str]:
    """A fresh Postgres database ``wq_bench_<tag>_<random>``, dropped afterwards."""
    name = f"wq_bench_{tag}_{uuid.uuid4().hex[:8]}"
    eng = sa.create_engine(resolve_url(admin), isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield pg_url(admin, name)
    finally:
        with eng.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        eng.dispose()


@contextlib.contextmanager
def scratch_sqlite(tag: str = "x") -> Iterator[str]:
    """A fresh SQLite file in a temporary folder (on local disk), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"wq_bench_{tag}_", dir=os.environ.get("WQ_SQL_BENCH_TMP")) as d:
        yield f"sqlite:///{Path(d) / 'bench.db'}"


@contextlib.contextmanager
def scratch(backend: str, admin: str = PG_ADMIN, tag: str = "x") -> Iterator[str]:
    if backend == "sqlite":
        with scratch_sqlite(tag) as u:
            yield u
    else:
        with scratch_pg(admin, tag) as u:
            yield u


def clone_queue(url: str, src: str, dst: str) -> None:
    """Copy queue ``src`` (config, works, items of epoch 0, all pending) to a new queue ``dst``,
    server-side: a fresh queue of the same size in well under a second, so every run starts from
    an untouched queue without paying the creation again."""
    eng = sa.create_engine(resolve_url(url))
    try:
        with eng.begin() as c:
            cols = ("works_digest, n_works, num_epochs, shuffle, seed, num_slices, prefix, "
                    "max_attempts, epochs_created")
            c.execute(sa.text(f"INSERT INTO wq_queues (name, {cols}) SELECT :dst, {cols} "
                              "FROM wq_queues WHERE name = :src"), {"src": src, "dst": dst})
            ids = c.execute(sa.text("SELECT (SELECT id FROM wq_queues WHERE name = :src), "
                                    "(SELECT id FROM wq_queues WHERE name = :dst)"),
                            {"src": src, "dst": dst}).one()
            s, d = ids
            c.execute(sa.text("INSERT INTO wq_works (queue_id, idx, work) SELECT :d, idx, work "
                              "FROM wq_works WHERE queue_id = :s"), {"s": s, "d": d})
            c.execute(sa.text("INSERT INTO wq_items (queue_id, epoch, seq, work_idx, state, attempts) "
                              "SELECT :d, epoch, seq, work_idx, 'pending', 0 FROM wq_items "
                              "WHERE queue_id = :s ORDER BY epoch, seq"), {"s": s, "d": d})
        if eng.dialect.name == "postgresql":
            with eng.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
                c.exec_driver_sql("ANALYZE wq_items")
    finally:
        eng.dispose()


def queue_id(url: str, name: str) -> int:
    eng = sa.create_engine(resolve_url(url))
    try:
        with eng.connect() as c:
            return int(c.execute(sa.text("SELECT id FROM wq_queues WHERE name = :n"), {"n": name}).scalar_one())
    finally:
        eng.dispose()


def pct(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100), nearest rank; nan for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(round(p / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> dict[str, Any]:
    """What BENCHMARKS.md prints above every table."""
    mem_kb = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    pg = ""
    with contextlib.suppress(Exception):
        eng = sa.create_engine(resolve_url(PG_ADMIN))
        with eng.connect() as c:
            pg = c.exec_driver_sql("SHOW server_version").scalar_one()
        eng.dispose()
    return {"nproc": os.cpu_count(), "cpu": cpu, "mem_gib": round(mem_kb / 2**20, 1),
            "python": platform.python_version(), "sqlite": sqlite3.sqlite_version,
            "postgres": pg, "sqlalchemy": sa.__version__,
            "load1": round(os.getloadavg()[0], 2)}


def git_rev() -> Optional[str]:
    with contextlib.suppress(Exception):
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
        if SRC != ROOT:
            return f"{rev} checkout; wq_sql imported from {SRC}"
        return rev + (" (dirty)" if subprocess.run(
            ["git", "status", "--porcelain", "wq_sql"], cwd=ROOT, capture_output=True,
            text=True).stdout.strip() else "")
    return None


# ---------------------------------------------------------------- a throwaway Postgres cluster


def add_pg_args(ap: argparse.ArgumentParser) -> None:
    """``--pg ADMIN_URL`` (the shared server), or ``--cluster`` (a throwaway one, below)."""
    ap.add_argument("--pg", default=PG_ADMIN, help="admin URL of the Postgres server (scratch databases)")
    ap.add_argument("--cluster", action="store_true",
                    help="run on a throwaway cluster (tests/support/pgcluster.py: initdb + pg_ctl on a free port) "
                         "with initdb's stock settings plus --pg-set, instead of --pg")
    ap.add_argument("--pg-set", action="append", default=[], metavar="NAME=VALUE",
                    help="with --cluster: a postgresql.conf setting (repeatable)")


@contextlib.contextmanager
def pg_server(a: argparse.Namespace, settings: Optional[dict[str, str]] = None) -> Iterator[str]:
    """The admin URL to run on: ``a.pg``, or with ``a.cluster`` a throwaway cluster (stock
    settings plus ``settings`` plus ``--pg-set``), stopped and deleted afterwards."""
    if not getattr(a, "cluster", False):
        yield a.pg
        return
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from pgcluster import PgCluster  # the tests' throwaway cluster

    conf = dict(settings or {})
    conf.update(kv.split("=", 1) for kv in a.pg_set)
    # Not in /tmp: one cluster's data directory there disappeared mid-benchmark (most likely a
    # cleanup of leftover /tmp/wq_sql_pgcluster.* by a test run) and the server shut down.
    base = Path(os.environ.get("WQ_SQL_BENCH_TMP") or "/var/tmp/wq_bench_clusters")
    base.mkdir(mode=0o755, parents=True, exist_ok=True)
    with PgCluster(dict(conf), base_dir=str(base)) as pg:
        print(f"# throwaway cluster {pg.url()} (data in {pg.dir}), settings beyond initdb's: {conf}", flush=True)
        yield pg.url()


def server_settings(admin: str) -> dict[str, str]:
    """The settings that shape the Postgres figures, as the server reports them."""
    names = ("server_version", "autovacuum", "autovacuum_naptime", "autovacuum_vacuum_scale_factor",
             "autovacuum_vacuum_insert_scale_factor", "max_connections", "shared_buffers",
             "synchronous_commit", "fsync")
    eng = sa.create_engine(resolve_url(admin))
    try:
        with eng.connect() as c:
            return {n: c.exec_driver_sql(f"SHOW {n}").scalar_one() for n in names}
    finally:
        eng.dispose()


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory (``VmRSS``) or its peak (``VmHWM``), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def dump(path: Optional[str], data: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=1, default=str))


class DurableRounds:
    """Only the durable statements wq_sql makes per item, by the raw driver: claim rounds of up
    to ``n`` items (``claim.ClaimRound``, the statement wq_sql runs), each also marking the
    previous round's items done, with their history rows and counters. No hand-over of items,
    no heartbeat, no Python of wq_sql but the round's own. The floor sides of the loader
    benchmarks (``torch_loader.py --floor``, ``tf_textline.py --floor``) run these beside the
    plain reading: what any loader that claims and completes every item durably costs at least.
    ``qid``, ``worker_id``: a queue and a worker row made beforehand (:func:`floor_queue`)."""

    def __init__(self, url: str, qid: int, worker_id: int, n: int) -> None:
        from sqlalchemy.engine import make_url

        from wq_sql.store.dialects import Dialect
        from wq_sql.store.hot.claim import ClaimRound

        self.qid, self.worker_id = qid, worker_id
        u = make_url(url)
        sqlite = u.get_backend_name() == "sqlite"
        if sqlite:
            self.conn: Any = sqlite3.connect(str(u.database), isolation_level=None, timeout=30,
                                           check_same_thread=False)  # made here, used in a thread
        else:
            import psycopg2

            self.conn = psycopg2.connect(host=u.host, port=u.port, user=u.username, password=u.password,
                                         dbname=u.database)
            self.conn.autocommit = True  # the round is one statement, its own transaction
        dialect = Dialect("sqlite" if sqlite else "postgresql")
        self._round = ClaimRound(dialect, n, 60.0)
        # SQLite: wq_sql's writers' queue in front of BEGIN IMMEDIATE, so that a writer waiting for
        # the lock is woken when it is free, not by the busy handler's sleeps.
        self._turns = dialect.writer_queue(u) if sqlite else None
        self._acks: list[tuple[int, int]] = []

    def next(self, limit: Optional[int] = None) -> tuple[list[Any], dict[int, str]]:
        """One round: the previous round's items done, up to ``limit`` (default ``n``) claimed,
        as (claimed items, work by work index)."""
        if self._turns is None:
            _, claimed, works = self._round.run(self.conn, self.qid, self.worker_id, self._acks, limit)
        else:
            with self._turns.turn():
                self.conn.execute("BEGIN IMMEDIATE")
                _, claimed, works = self._round.run(self.conn, self.qid, self.worker_id, self._acks, limit)
                self.conn.execute("COMMIT")
        self._acks = [(c.id, c.token) for c in claimed]
        return claimed, works

    def drain(self) -> Iterator[str]:
        """Every item's work string, round after round, the last round's items marked done at the
        end; closes the connection."""
        while True:
            claimed, works = self.next()
            if not claimed:
                break
            for c in claimed:
                yield works[c.work_idx]
        self.next(0)
        self.conn.close()


def floor_queue(works: list[str], url: str, name: str, workers: int) -> tuple[int, list[int]]:
    """For :class:`DurableRounds`: a queue of ``works`` and ``workers`` registered worker rows
    (closed queue objects: their rows stay), as ``(queue id, worker ids)``."""
    import wq_sql

    wq_sql.WorkQueue(works, name=name, url=url, shuffle=True, worker="floor-maker").close()
    ids = []
    for k in range(workers):
        q = wq_sql.WorkQueue.attach(name, url=url, worker=f"floor{k}")
        ids.append(q.worker_id)
        q.close()
    return queue_id(url, name), ids
