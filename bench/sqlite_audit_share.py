"""What each audit write costs SQLite's claim round (issue 16): the round itself, with no
``take()`` around it, on a copy of one queue file, in five variants run alternately:

* ``full``      ``claim.ClaimRound`` as wq_sql runs it (acks, their ``done`` history rows, the
                tally upsert, the claim with its work strings);
* ``noindex``   the same without the history table's index (``ix_wq_events_queue_item``);
* ``notally``   the tally upsert replaced by a ``SELECT`` of its parameters;
* ``noevents``  the history rows replaced the same way;
* ``none``      neither tally nor history rows nor index: the round without its audit trail;
* ``raw``       the reference round of ``claim_throughput.py`` (its ``raw`` variant: the acks by
                ``executemany`` without ``RETURNING``, the claim, a ``SELECT`` of the works), on
                the same kind of connection: what the targets' ratios are taken against.

Each round runs in ``BEGIN IMMEDIATE`` / ``COMMIT`` on one ``sqlite3`` connection (WAL,
``synchronous=NORMAL``, foreign keys enforced, automatic checkpoints off and a passive
checkpoint every second, as wq_sql's engines and heartbeat do). Also measured, on another copy: ``WorkQueue.take()`` in a
loop (defaults but ``lease_ahead``), so the library's share shows beside the audit's. Ratios are
against ``full`` of the same run; medians of ``--repeats``.

    .venv/bin/python bench/sqlite_audit_share.py                 # lease-ahead 1 and 32
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, machine  # noqa: E402
from claim_throughput import _SQ_ACK, _sq_claim  # noqa: E402

from wq_sql import WorkQueue  # noqa: E402
from wq_sql.claim import ClaimRound  # noqa: E402
from wq_sql.dialects import Dialect  # noqa: E402

VARIANTS = ("full", "noindex", "notally", "noevents", "none", "raw")


def _copy(base: Path, path: Path) -> None:
    for ext in ("", "-wal", "-shm", "-wqturns"):
        Path(f"{path}{ext}").unlink(missing_ok=True)
    shutil.copy(base, path)


def rounds(base: Path, work: Path, variant: str, n: int, seconds: float) -> float:
    """Items per second of bare claim rounds of ``variant``."""
    path = work / f"{variant}.db"
    _copy(base, path)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute("PRAGMA foreign_keys=ON")  # as wq_sql's connections and claim_throughput.py's raw
    if variant in ("noindex", "none"):
        conn.execute("DROP INDEX ix_wq_events_queue_item")
    qid = conn.execute("SELECT id FROM wq_queues").fetchone()[0]
    wid = conn.execute("SELECT id FROM wq_workers").fetchone()[0]
    rnd = ClaimRound(Dialect("sqlite"), n, 60.0)
    if variant in ("notally", "none"):  # the same parameters, nothing written
        rnd._tally = "SELECT ?, ?, ?, ?"
    if variant in ("noevents", "none"):
        rnd._event1 = "SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?"
        rnd._events = "SELECT ?, ? FROM (VALUES {rows})"
    acks: list[tuple[int, int]] = []
    count = token = 0
    claim = _sq_claim(n, works=False)
    t0 = last = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        conn.execute("BEGIN IMMEDIATE")
        if variant == "raw":
            token += 1
            conn.executemany(_SQ_ACK, acks)
            rows = conn.execute(claim, (qid, wid, token)).fetchall()
            if rows:
                idx = sorted({r[1] for r in rows})
                conn.execute(f"SELECT idx, work FROM wq_works WHERE queue_id = ? AND idx IN "
                             f"({','.join('?' * len(idx))})", (qid, *idx)).fetchall()
            acks = [(r[0], token) for r in rows]
        else:
            _, got, _ = rnd.run(conn, qid, wid, acks)
            acks = [(g.id, g.token) for g in got]
        conn.execute("COMMIT")
        count += len(acks)
        if time.perf_counter() - last > 1.0:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            last = time.perf_counter()
    elapsed = time.perf_counter() - t0
    conn.close()
    return count / elapsed


def takes(base: Path, work: Path, n: int, seconds: float) -> float:
    """Items per second of ``WorkQueue.take()`` in a loop on a copy of the same file."""
    path = work / "take.db"
    _copy(base, path)
    q = WorkQueue.attach("q", url=f"sqlite:///{path}", worker="c", lease_ahead=n)
    k = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        q.take()
        k += 1
    elapsed = time.perf_counter() - t0
    q.close()
    return k / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=300_000)
    ap.add_argument("--lease-ahead", default="1,32")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print("#", machine(), "rev", git_rev(), flush=True)
    with tempfile.TemporaryDirectory(prefix="wq_audit_") as tmp:
        work = Path(tmp)
        base = work / "base.db"
        # The creator's row is the worker the rounds claim as.
        WorkQueue([f"w{i}" for i in range(a.items)], url=f"sqlite:///{base}", name="q", worker="c",
                  shuffle=False).close()
        print("| lease_ahead | " + " | ".join(VARIANTS) + " | `take()` | load |")
        print("|---|" + "---|" * (len(VARIANTS) + 2))
        for n in (int(x) for x in a.lease_ahead.split(",")):
            res: dict[str, list[float]] = {v: [] for v in (*VARIANTS, "take")}
            for _ in range(a.repeats):
                for v in VARIANTS:
                    res[v].append(rounds(base, work, v, n, a.seconds))
                res["take"].append(takes(base, work, n, a.seconds))
            full = statistics.median(res["full"])
            cells = [f"{statistics.median(r):,.0f}/s ({statistics.median(r) / full:.2f}x)" for r in res.values()]
            print(f"| {n} | " + " | ".join(cells) + f" | {os.getloadavg()[0]:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
