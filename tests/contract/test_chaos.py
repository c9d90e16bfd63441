"""Chaos, short form (CI): real worker processes SIGKILLed at random during a 2-epoch drain and
restarted under the same or a new identity, on both backends; and 8 processes hammering one
SQLite file. Afterwards the table is checked by SQL: every ``(epoch, seq)`` done exactly once,
and the items delivered more than once are exactly the items a killed worker held.

"Held by a killed worker" is read from the history, not guessed from wall clocks: one row per
delivery (``tests/support/deliveries.py`` replays them and checks what holds for any queue), each ended
by ``done`` or abandoned (``expire``, or ``recover`` by its restarted identity), which only a
killed process does here (nobody releases or fails, and leases outlast any stall).
``bench/chaos_soak.py`` runs the same drain for longer.

Run as a script, this file is the worker: ``python tests/contract/test_chaos.py URL NAME WORKER LOG``.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
# bench/chaos_soak.py raises these for a long soak.
N_WORKS = int(os.environ.get("WQ_SQL_CHAOS_WORKS", "120"))
MAX_KILLS = int(os.environ.get("WQ_SQL_CHAOS_KILLS", "10"))
EPOCHS = 2
QUEUE = "chaos"


# ---------------------------------------------------------------- the worker (run as a script)


def worker_main(url: str, name: str, worker: str, log_path: str, item_ms: float, seed: int) -> int:
    from wq_sql import WorkQueue

    rng = random.Random(seed)
    wq = WorkQueue([f"w{i:04d}" for i in range(N_WORKS)], num_epochs=EPOCHS, seed=11, name=name, url=url,
                   worker=worker, lease_seconds=4.0, heartbeat_seconds=0.4, poll_seconds=0.1,
                   max_attempts=50)
    with open(log_path, "a", encoding="utf-8") as log:
        for item in wq:
            log.write(f"{item.epoch} {item.seq}\n")
            log.flush()
            time.sleep(item_ms / 1e3 * (0.5 + rng.random()))
    wq.close()
    return 0


# ---------------------------------------------------------------- the tests' side


class Worker:
    def __init__(self, url: str, tmp: Path, worker: str, gen: int, item_ms: float) -> None:
        self.worker, self.log = worker, tmp / f"{worker}.{gen}.log"
        self.err = open(tmp / f"{worker}.{gen}.err", "wb")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("WQ_SQL_WORKER", None)
        env.pop("TF_CONFIG", None)
        self.p = subprocess.Popen([sys.executable, __file__, url, QUEUE, worker, str(self.log), str(item_ms),
                                   str(gen)], stdout=subprocess.DEVNULL, stderr=self.err, env=env)

    def stderr(self) -> str:
        if not self.err.closed:
            self.err.flush()
        return Path(self.err.name).read_text(errors="replace")

    def received(self) -> list[tuple[int, int]]:
        if not self.log.exists():
            return []
        return [(int(e), int(s)) for e, s in (ln.split() for ln in self.log.read_text().splitlines())]


def _query(url: str, sql: str) -> list[Any]:
    from worker_proc import query

    return query(url, sql)


def _lingering_idle_in_transaction(url: str, stop: threading.Event, seen: list[Any]) -> None:
    """Postgres: sample pg_stat_activity; a wq_sql session idle inside a transaction for more than
    a second is a transaction held across user code (or a leak)."""
    import sqlalchemy as sa

    from wq_sql.store.engine import resolve_url

    eng = sa.create_engine(resolve_url(url), isolation_level="AUTOCOMMIT")
    try:
        with eng.connect() as c:
            while not stop.is_set():
                rows = c.exec_driver_sql(
                    "SELECT pid, state, now() - state_change, query FROM pg_stat_activity "
                    "WHERE application_name = 'wq_sql' AND datname = current_database() "
                    "AND state LIKE 'idle in transaction%%' "
                    "AND now() - state_change > interval '1 second'").all()
                seen.extend(rows)
                stop.wait(0.1)
    finally:
        eng.dispose()


def _check_exactly_once(url: str, workers: list[Worker], killed: set[str]) -> dict[str, int]:
    total = N_WORKS * EPOCHS
    states = _query(url, f"SELECT state, count(*) FROM wq_audit WHERE queue = '{QUEUE}' GROUP BY state")
    assert dict(states) == {"done": total}, states
    doubles = _query(url, "SELECT epoch, seq, count(*) FROM wq_history "
                          f"WHERE queue = '{QUEUE}' AND kind = 'done' "
                          "GROUP BY epoch, seq HAVING count(*) <> 1")
    assert doubles == [], f"(epoch, seq) done other than once: {doubles}"
    n_done = _query(url, f"SELECT count(*) FROM wq_history WHERE queue = '{QUEUE}' AND kind = 'done'")
    assert n_done == [(total,)]

    # Replay each item's deliveries (the stored rows, one per delivery): each ends in done, or was
    # abandoned: expire (the lease ran out) or recover (its identity was restarted and took it back).
    from deliveries import replay

    history = replay(url, QUEUE)
    kinds = collections.Counter(d.end for ds in history.values() for d in ds)
    assert set(kinds) <= {"recover", "done", "expire"}, kinds  # nobody released or failed
    assert set(history) == {(e, s) for e in range(EPOCHS) for s in range(N_WORKS)}
    abandoned_by: dict[tuple[int, int], list[Optional[str]]] = {
        key: [d.worker for d in ds if d.end != "done"] for key, ds in history.items()}
    abandoned_by = {key: ws for key, ws in abandoned_by.items() if ws}
    for key, ds in history.items():
        assert [d.end for d in ds].count("done") == 1 and ds[-1].end == "done", f"{key}: {ds}"
    redelivered = {key for key, ds in history.items() if len(ds) > 1}
    assert redelivered == set(abandoned_by), (
        f"re-delivered but not abandoned: {sorted(redelivered - set(abandoned_by))}; "
        f"abandoned but not re-delivered: {sorted(set(abandoned_by) - redelivered)}")
    holders = {w for ws in abandoned_by.values() for w in ws}
    assert holders <= killed, f"items abandoned by workers never killed: {holders - killed}"

    # What the processes themselves received: everything, and each item not re-delivered once.
    got = collections.Counter(key for w in workers for key in w.received())
    assert set(got) == {(e, s) for e in range(EPOCHS) for s in range(N_WORKS)}
    assert {k for k, n in got.items() if n > 1} <= redelivered
    return {"killed_identities": len(killed), "redelivered": len(redelivered), "expired": kinds["expire"],
            "recovered": kinds["recover"]}


def test_sigkill_random_workers_during_a_two_epoch_drain(db_url: str, backend: str, tmp_path: Path) -> None:
    """4 workers; every 0.15-0.4 s one of them is SIGKILLed and restarted, half the time under its
    own identity (it recovers its items at once), half under a new one (they come back when the
    lease expires), until 85% of the items were received."""
    seed = int(os.environ.get("WQ_SQL_CHAOS_SEED") or int.from_bytes(os.urandom(4), "big"))
    rng = random.Random(seed)
    seed_note = f"(WQ_SQL_CHAOS_SEED={seed} repeats the kill schedule)"
    n_procs, item_ms = 4, 25.0
    gens: collections.Counter[str] = collections.Counter()
    live: dict[str, Worker] = {}
    everyone: list[Worker] = []

    def spawn(name: str) -> None:
        w = Worker(db_url, tmp_path, name, gens[name], item_ms)
        gens[name] += 1
        live[name] = w
        everyone.append(w)

    stop = threading.Event()
    lingering: list[Any] = []
    sampler: Optional[threading.Thread] = None
    if backend == "postgresql":
        sampler = threading.Thread(target=_lingering_idle_in_transaction, args=(db_url, stop, lingering),
                                   daemon=True)
        sampler.start()
    killed: set[str] = set()
    kills = 0
    try:
        # The first creates the queue; the rest join (concurrent creation is covered elsewhere).
        spawn("w0")
        for i in range(1, n_procs):
            spawn(f"w{i}")
        deadline = time.monotonic() + 90 + N_WORKS * EPOCHS * item_ms / 1e3
        fresh = 0
        while time.monotonic() < deadline and kills < MAX_KILLS:
            time.sleep(rng.uniform(0.15, 0.4))
            received = sum(len(w.received()) for w in everyone)
            if received > 0.85 * N_WORKS * EPOCHS:
                break
            if received < 5:
                continue  # let the queue exist and the workers start
            busy = sorted(n for n, w in live.items() if w.received())  # past startup, holding an item
            if not busy:
                continue
            name = rng.choice(busy)
            victim = live.pop(name)
            victim.p.send_signal(signal.SIGKILL)
            victim.p.wait(30)
            killed.add(name)
            kills += 1
            if rng.random() < 0.5:
                spawn(name)  # same identity: takes its items back at once
            else:
                fresh += 1
                spawn(f"n{fresh}")  # a new identity: the old one's items come back after the lease
        for w in list(live.values()):
            rc = w.p.wait(timeout=max(5.0, deadline - time.monotonic()))
            assert rc == 0, f"{w.worker} exited {rc}:\n{w.stderr()}"
        assert kills >= 3, f"only {kills} kills landed before the drain ended {seed_note}"
    finally:
        stop.set()
        if sampler is not None:
            sampler.join(10)
        for w in everyone:
            if w.p.poll() is None:
                w.p.kill()
                w.p.wait(30)
            w.err.close()
    summary = _check_exactly_once(db_url, everyone, killed)
    print("chaos:", backend, "kills", kills, summary)
    assert summary["redelivered"] >= 2, f"kills hit too few held items {summary} {seed_note}"
    assert lingering == [], f"wq_sql sessions idle in transaction for > 1 s: {lingering}"
    for w in everyone:
        assert "database is locked" not in w.stderr()


def test_sqlite_eight_processes_hammering_one_file(tmp_path: Path) -> None:
    """No per-item work at all: 8 processes claim as fast as they can, so the write lock is
    contended all the time. Nothing 'database is locked' may reach the user, every item is done
    exactly once, and the file passes ``PRAGMA integrity_check``."""
    import sqlite3

    url = f"sqlite:///{tmp_path / 'hammer.db'}"
    from wq_sql import WorkQueue

    WorkQueue([f"w{i:04d}" for i in range(N_WORKS)], num_epochs=EPOCHS, seed=11, name=QUEUE, url=url,
              worker="creator", max_attempts=50).close()
    workers = [Worker(url, tmp_path, f"h{i}", 0, 0.0) for i in range(8)]
    try:
        for w in workers:
            rc = w.p.wait(timeout=90)
            assert rc == 0, f"{w.worker} exited {rc}:\n{w.stderr()}"
    finally:
        for w in workers:
            if w.p.poll() is None:
                w.p.kill()
                w.p.wait(30)
            w.err.close()
    for w in workers:
        err = w.stderr()
        assert "locked" not in err and "DatabaseBusy" not in err, err
    _check_exactly_once(url, workers, killed=set())
    redone = _query(url, "SELECT count(*) FROM wq_history "
                         f"WHERE queue = '{QUEUE}' AND kind IN ('expire', 'recover')")
    assert redone == [(0,)]
    con = sqlite3.connect(tmp_path / "hammer.db")
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        con.close()


if __name__ == "__main__":
    url_, name_, worker_, log_, item_ms_, seed_ = sys.argv[1:7]
    sys.exit(worker_main(url_, name_, worker_, log_, float(item_ms_), int(seed_)))
