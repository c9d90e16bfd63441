"""What idle workers cost the server: N workers that each hold one item and only heartbeat, on
a scratch Postgres database, with the look for lost items sampled (about ``LOOKS_PER_HOST`` of a
host's workers look per heartbeat period, ``wq_sql.lease.looks_this_beat``) against every worker
looking at every beat (the reference, as before the sampling), measured in the same run.

Reported per variant: commits per second and rows read per second from ``wq_workers`` and
``wq_items`` (``pg_stat_user_tables``: sequential plus index tuple reads), over the same window.
All workers run on this host, so the sampled variant has ``LOOKS_PER_HOST`` lookers per period in
all; on H hosts it has H times that.

    .venv/bin/python bench/lookers.py --workers 60 --procs 3 --heartbeat 0.5 --seconds 20
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import sqlalchemy as sa
from _common import PG_ADMIN, scratch_pg

from wq_sql import WorkQueue

STATS = """
SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),
       (SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables
         WHERE relname = 'wq_workers'),
       (SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables
         WHERE relname = 'wq_items')
"""


def worker_proc(url: str, name: str, first: int, count: int, beat: float, every_beat: bool,
                ready: Any, stop: Any) -> None:
    if every_beat:
        import wq_sql.lease
        wq_sql.lease.LOOKS_PER_HOST = 10**9  # every worker looks at every beat
    queues = []
    for i in range(first, first + count):
        q = WorkQueue.attach(name, url=url, worker=f"w{i}", lease_seconds=max(60.0, 4 * beat),
                             heartbeat_seconds=beat, auto_complete=False)
        q.take()  # held for the whole run: claimed rows for the lease sweep to scan
        queues.append(q)
    ready.release()
    stop.wait()
    for q in queues:
        q.close()


def stats(url: str) -> tuple[int, int, int]:
    eng = sa.create_engine(url)
    try:
        with eng.connect() as c:
            c.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
            row = c.execute(sa.text(STATS)).one()
    finally:
        eng.dispose()
    return int(row[0]), int(row[1] or 0), int(row[2] or 0)


def run(url: str, variant: str, args: argparse.Namespace) -> dict[str, float]:
    name = f"idle_{variant}"
    WorkQueue([f"w{i}" for i in range(args.workers * 2)], name=name, url=url).close()
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Semaphore(0), ctx.Event()
    per = args.workers // args.procs
    ps = [ctx.Process(target=worker_proc, args=(url, name, p * per, per, args.heartbeat,
                                                variant == "every_beat", ready, stop))
          for p in range(args.procs)]
    for p in ps:
        p.start()
    for _ in ps:
        ready.acquire(timeout=300)
    time.sleep(3 * args.heartbeat)  # every worker has looked once and knows its host's count
    time.sleep(1.0)  # the statistics collector's lag
    t0, a = time.monotonic(), stats(url)
    time.sleep(args.seconds)
    time.sleep(1.0)
    t1, b = time.monotonic(), stats(url)
    stop.set()
    for p in ps:
        p.join(60)
    dt = t1 - t0
    return {"commits_s": (b[0] - a[0]) / dt, "workers_rows_s": (b[1] - a[1]) / dt,
            "items_rows_s": (b[2] - a[2]) / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=60)
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--heartbeat", type=float, default=0.5)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pg", default=PG_ADMIN)
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {"every_beat": [], "sampled": []}
    with scratch_pg(args.pg, "lookers") as url:
        for r in range(args.rounds):
            for variant in (("every_beat", "sampled") if r % 2 == 0 else ("sampled", "every_beat")):
                got = run(url, variant, args)
                results[variant].append(got)
                print(f"round {r} {variant}: " + ", ".join(f"{k} {v:,.0f}" for k, v in got.items()),
                      flush=True)
    print(f"\n{args.workers} idle workers in {args.procs} processes on one host, heartbeat "
          f"{args.heartbeat} s, {args.seconds} s windows, {args.rounds} rounds (medians):")
    print("| variant | commits/s | wq_workers rows read/s | wq_items rows read/s |")
    print("|---|---|---|---|")
    med: dict[str, dict[str, float]] = {}
    for variant, runs in results.items():
        med[variant] = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        m = med[variant]
        print(f"| {variant} | {m['commits_s']:,.0f} | {m['workers_rows_s']:,.0f} | {m['items_rows_s']:,.0f} |")
    s, e = med["sampled"], med["every_beat"]
    print("| sampled / every_beat | " + " | ".join(
        f"{s[k] / e[k]:.2f}x" if e[k] else "-" for k in ("commits_s", "workers_rows_s", "items_rows_s")) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
