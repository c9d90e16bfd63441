"""Scale: creating a queue of 1,000,000 works, and claim latency over a long drain.

``create``: time and peak memory of ``WorkQueue(works)`` for N works against a raw bulk insert of
the same rows (the queue row, N ``wq_works`` rows, N shuffled ``wq_items`` rows, one transaction)
through the driver in the same run: ``executemany`` on sqlite3, ``execute_values`` on psycopg2,
and on Postgres also ``COPY`` (the fastest load there is, for scale). Each measurement runs in a
fresh process (spawned) and a fresh database; memory is the peak RSS above the process's RSS
once the works list is built (``ru_maxrss``).

``drain``: P worker processes ``take()`` (lease-ahead n) until the queue is exhausted; every
round trip's latency is recorded with its time. Reported: p50/p99 latency of the first 10% and
the last 10% of the round trips (target: last within 1.5x of first), and throughput per tenth of
the drain. No manual VACUUM; the server's autovacuum setting is printed (it is ``off`` on the
shared server this was written on, which is the harsh case: nothing cleans dead tuples).

    .venv/bin/python bench/scale.py create --backend sqlite --n 1000000 --repeats 3
    .venv/bin/python bench/scale.py create --backend postgresql --n 1000000 --repeats 3
    .venv/bin/python bench/scale.py drain --backend postgresql --n 200000 --procs 4
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sqlalchemy as sa  # noqa: E402
from _common import PG_ADMIN, dump, git_rev, machine, median, pct, scratch  # noqa: E402

from wq_sql import QueueExhausted, WorkQueue  # noqa: E402
from wq_sql.engine import resolve_url  # noqa: E402

QUEUE = "scale"


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _cur_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


# ---------------------------------------------------------------- create


def _create_child(mode: str, url: str, n: int, out: Any) -> None:
    works = [f"s3://bucket/dataset/part-{i:07d}.parquet" for i in range(n)]
    base = _cur_rss_mib()
    t = time.perf_counter()
    if mode == "wq_sql":
        WorkQueue(works, num_epochs=2, shuffle=True, seed=7, name=QUEUE, url=url, worker="creator").close()
    else:
        _raw_create(mode, url, works)
    dt = time.perf_counter() - t
    out.put((dt, _rss_mib() - base, _rss_mib()))


def _raw_create(mode: str, url: str, works: list[str]) -> None:
    """The same rows as ``ops.create_queue``, through the driver, one transaction."""
    from wq_sql.plan import epoch_order, works_digest

    order = epoch_order(len(works), 0, True, 7)
    u = resolve_url(url)
    digest = works_digest(works)
    if u.get_backend_name() == "sqlite":
        import sqlite3

        conn = sqlite3.connect(u.database, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        cur = conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        cur.execute("INSERT INTO wq_queues (name, works_digest, n_works, num_epochs, shuffle, seed, max_attempts, "
                    "epochs_created) VALUES (?, ?, ?, 2, 1, 7, 3, 1) RETURNING id", (QUEUE, digest, len(works)))
        qid = cur.fetchone()[0]
        cur.executemany("INSERT INTO wq_works (queue_id, idx, work) VALUES (?, ?, ?)",
                        ((qid, i, w) for i, w in enumerate(works)))
        cur.executemany("INSERT INTO wq_items (queue_id, epoch, seq, work_idx, state, attempts) "
                        "VALUES (?, 0, ?, ?, 'pending', 0)", ((qid, s, i) for s, i in enumerate(order)))
        cur.execute("COMMIT")
        conn.close()
        return
    import io

    import psycopg2
    from psycopg2.extras import execute_values

    conn = psycopg2.connect(host=u.host, port=u.port or 5432, user=u.username, dbname=u.database)
    cur = conn.cursor()
    cur.execute("INSERT INTO wq_queues (name, works_digest, n_works, num_epochs, shuffle, seed, max_attempts, "
                "epochs_created) VALUES (%s, %s, %s, 2, true, 7, 3, 1) RETURNING id", (QUEUE, digest, len(works)))
    qid = cur.fetchone()[0]
    if mode == "raw":
        execute_values(cur, "INSERT INTO wq_works (queue_id, idx, work) VALUES %s",
                       ((qid, i, w) for i, w in enumerate(works)), page_size=10_000)
        execute_values(cur, "INSERT INTO wq_items (queue_id, epoch, seq, work_idx, state, attempts) VALUES %s",
                       ((qid, 0, s, i, "pending", 0) for s, i in enumerate(order)), page_size=10_000)
    else:  # COPY
        buf = io.StringIO("".join(f"{qid}\t{i}\t{w}\n" for i, w in enumerate(works)))
        cur.copy_expert("COPY wq_works (queue_id, idx, work) FROM STDIN", buf)
        buf = io.StringIO("".join(f"{qid}\t0\t{s}\t{i}\tpending\t0\n" for s, i in enumerate(order)))
        cur.copy_expert("COPY wq_items (queue_id, epoch, seq, work_idx, state, attempts) FROM STDIN", buf)
    conn.commit()
    conn.close()


def _prepare(url: str) -> None:
    import wq_sql

    wq_sql.upgrade(url)


def cmd_create(a: argparse.Namespace) -> None:
    modes = ["wq_sql", "raw"] + (["raw_copy"] if a.backend == "postgresql" else [])
    ctx = mp.get_context("spawn")
    runs: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    for rep in range(a.repeats):
        for m in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            with scratch(a.backend, a.pg, tag="create") as url:
                _prepare(url)
                out = ctx.Queue()
                p = ctx.Process(target=_create_child, args=(m, url, a.n, out))
                p.start()
                r = out.get(timeout=3600)
                p.join()
                runs[m].append(r)
                print(f"  {a.backend} create {a.n} rep {rep} {m:8s}: {r[0]:.2f}s  peak +{r[1]:.0f} MiB "
                      f"(peak RSS {r[2]:.0f} MiB)", flush=True)
    print(f"\n## create {a.n} works on {a.backend}: medians of {a.repeats} runs\n")
    print("| variant | seconds | vs raw | peak memory above the works list, MiB | peak RSS MiB |")
    print("|---|---|---|---|---|")
    for m in modes:
        ratio = median([w[0] / r[0] for w, r in zip(runs[m], runs["raw"])])
        print(f"| {m} | {median([r[0] for r in runs[m]]):.2f} | {ratio:.2f} | {median([r[1] for r in runs[m]]):.0f} "
              f"| {median([r[2] for r in runs[m]]):.0f} |")
    dump(a.json, runs)


# ---------------------------------------------------------------- drain


def _drain_child(url: str, i: int, la: int, full_scan_every: int, ready: Any, go: Any, out: Any) -> None:
    if full_scan_every:
        from wq_sql import ops

        ops.ClaimRound.FULL_SCAN_EVERY = full_scan_every  # 1: every claim scans from the start (no floor)
    wq = WorkQueue.attach(QUEUE, url=url, worker=f"d{i}", lease_ahead=la)
    rec: list[tuple[float, float]] = []
    ready.set()
    go.wait()
    n = 0
    while True:
        trip = not wq._buffer
        t = time.perf_counter()
        try:
            wq.take()
        except QueueExhausted:
            break
        if trip:
            rec.append((time.time(), time.perf_counter() - t))
        n += 1
    wq.close()
    out.put((i, n, rec))


def cmd_drain(a: argparse.Namespace) -> None:
    ctx = mp.get_context("fork")
    with scratch(a.backend, a.pg, tag="drain") as url:
        t = time.perf_counter()
        WorkQueue([f"part-{i:07d}" for i in range(a.n)], num_epochs=1, shuffle=True, seed=7, name=QUEUE,
                  url=url, worker="creator").close()
        print(f"# created {a.n} items in {time.perf_counter() - t:.1f}s", flush=True)
        eng = sa.create_engine(resolve_url(url))
        with eng.connect() as c:
            if a.backend == "postgresql":
                print("# autovacuum:", c.exec_driver_sql("SHOW autovacuum").scalar_one(), flush=True)
        go, out = ctx.Event(), ctx.Queue()
        readies, ps = [], []
        for i in range(a.procs):
            r = ctx.Event()
            p = ctx.Process(target=_drain_child, args=(url, i, a.lease_ahead, a.full_scan_every, r, go, out))
            p.start()
            readies.append(r)
            ps.append(p)
        for r in readies:
            r.wait(120)
        t0 = time.time()
        go.set()
        res = [out.get(timeout=24 * 3600) for _ in ps]
        for p in ps:
            p.join(60)
        total = time.time() - t0
        stats = {}
        with eng.connect() as c:
            if a.backend == "postgresql":
                row = c.exec_driver_sql(
                    "SELECT n_live_tup, n_dead_tup, autovacuum_count, last_autovacuum, "
                    "pg_relation_size('ix_wq_items_pending') FROM pg_stat_user_tables "
                    "WHERE relname = 'wq_items'").one()
                stats = {"n_live_tup": row[0], "n_dead_tup": row[1], "autovacuum_count": row[2],
                         "last_autovacuum": row[3], "pending_index_bytes": row[4]}
        eng.dispose()
    rec = sorted(x for _, _, r in res for x in r)
    k = max(1, len(rec) // 10)
    first = [d for _, d in rec[:k]]
    last = [d for _, d in rec[-k:]]
    n = sum(r[1] for r in res)
    print(f"\n## drain {n} items on {a.backend}, {a.procs} workers, lease-ahead {a.lease_ahead}, "
          f"full scan every {a.full_scan_every or 'default'} rounds: "
          f"{total:.1f}s, {n / total:.0f} items/s\n")
    print("| tenth of the drain | round trips | items/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|")
    for d in range(10):
        part = rec[d * len(rec) // 10:(d + 1) * len(rec) // 10]
        span = part[-1][0] - part[0][0] if len(part) > 1 else float("nan")
        lat = [x for _, x in part]
        print(f"| {d + 1} | {len(part)} | {len(part) * a.lease_ahead / span:.0f} | {pct(lat, 50) * 1e3:.2f} "
              f"| {pct(lat, 99) * 1e3:.2f} |")
    r50 = pct(last, 50) / pct(first, 50)
    r99 = pct(last, 99) / pct(first, 99)
    print(f"\nfirst 10%: p50 {pct(first, 50) * 1e3:.2f} ms p99 {pct(first, 99) * 1e3:.2f} ms; last 10%: "
          f"p50 {pct(last, 50) * 1e3:.2f} ms p99 {pct(last, 99) * 1e3:.2f} ms; ratio p50 {r50:.2f} p99 {r99:.2f} "
          f"(target <= 1.5: {'met' if max(r50, r99) <= 1.5 else 'MISSED'})")
    print("table stats after the drain:", stats, flush=True)
    dump(a.json, {"n": n, "seconds": total, "first": first, "last": last, "stats": stats})


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["create", "drain"])
    ap.add_argument("--backend", default="postgresql", choices=["sqlite", "postgresql"])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--lease-ahead", type=int, default=1)
    ap.add_argument("--full-scan-every", type=int, default=0,
                    help="drain: override ClaimRound.FULL_SCAN_EVERY (1 = no floor, the claim before the fix)")
    ap.add_argument("--pg", default=PG_ADMIN)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    print("#", machine(), "rev", git_rev(), flush=True)
    cmd_create(a) if a.what == "create" else cmd_drain(a)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
