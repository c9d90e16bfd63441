"""Scale: creating a queue of 1,000,000 works, claim latency over a long drain (and over many
epochs), the epoch roll-over, and worker memory against the queue size.

``create``: time and peak memory of ``WorkQueue(works)`` for N works against a raw bulk insert of
the same rows (the queue row, N ``wq_works`` rows, N shuffled ``wq_items`` rows, one transaction)
through the driver in the same run: ``executemany`` on sqlite3, ``execute_values`` on psycopg2,
and on Postgres also ``COPY`` (the fastest load there is, for scale). Each measurement runs in a
fresh process (spawned) and a fresh database; memory is the peak RSS above the process's RSS
once the works list is built (``ru_maxrss``).

``drain``: P worker processes ``take()`` (lease-ahead n) until the queue is exhausted; every
round trip's latency is recorded with its time. Reported: p50/p99 latency of the first 10% and
the last 10% of the round trips (target: last within 1.5x of first), and throughput per tenth of
the drain. No manual VACUUM; the server's autovacuum setting is printed (``--cluster`` runs on a
throwaway cluster with stock settings, autovacuum on; the shared server this was written on has
it off, the harsh case). With ``--epochs E`` the queue has E epochs of N items, and the same is
reported per epoch (p50, p99, duration; target: no growth from epoch to epoch).

``rollover``: (1) the time to create one epoch of N items (``statements.advance_epoch``, as a worker
runs it) against the same rows inserted through the driver, same run; (2) the claim stall at the
boundary: epoch 0 is all done but its last ``--tail`` items and epoch 1 exists; P workers
(lease-ahead 1) drain the tail and go on into epoch 1, whose first claim makes epoch 2. Reported:
the median claim before the boundary, p99 and max of the claims started within 1 s of it
(target: no stall above 10x the median), and on Postgres what the workers' backends were doing
during the longest stall (``pg_stat_activity``, sampled).

``memory``: RSS of a fresh worker process that joins with ``WorkQueue.attach`` and takes
``--items`` items, for a 1,000-item and an N-item queue (each run on an untouched copy); also a
worker whose first claim makes the next epoch (the queue has 2 epochs; ``--no-rollover`` skips it).

    .venv/bin/python bench/scale.py create --backend sqlite --n 1000000 --repeats 3
    .venv/bin/python bench/scale.py create --backend postgresql --n 1000000 --repeats 3
    .venv/bin/python bench/scale.py drain --backend postgresql --cluster --n 1000000 --procs 4
    .venv/bin/python bench/scale.py drain --backend postgresql --cluster --n 10000 --epochs 10
    .venv/bin/python bench/scale.py rollover --backend postgresql --cluster --n 1000000
    .venv/bin/python bench/scale.py memory --backend sqlite --n 1000000
    .venv/bin/python bench/scale.py drain --quick --backend sqlite --epochs 3     # smoke run, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sqlalchemy as sa  # noqa: E402
from _common import (  # noqa: E402
    add_pg_args,
    clone_queue,
    dump,
    git_rev,
    machine,
    median,
    pct,
    pg_server,
    queue_id,
    rss_mib,
    scratch,
    server_settings,
)

from wq_sql import QueueExhausted, WorkQueue  # noqa: E402
from wq_sql.store.dialects.sqlite import FAIR_ENV  # noqa: E402
from wq_sql.store.engine import resolve_url  # noqa: E402

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
    """The same rows as ``statements.create_queue``, through the driver, one transaction."""
    from wq_sql.plan import epoch_order, works_digest

    order = epoch_order(len(works), 0, True, 7)
    u = resolve_url(url)
    digest = works_digest(works)
    if u.get_backend_name() == "sqlite":
        import sqlite3

        conn = sqlite3.connect(str(u.database), isolation_level=None)
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
        from wq_sql.store.hot.claim import ClaimRound

        ClaimRound.FULL_SCAN_EVERY = full_scan_every  # 1: every claim scans from the start (no floor)
    wq = WorkQueue.attach(QUEUE, url=url, worker=f"d{i}", lease_ahead=la)
    rec: list[tuple[float, float, int]] = []  # (wall clock at the start, seconds, epoch of the item)
    ready.set()
    go.wait()
    n = 0
    while True:
        trip = wq.buffered == 0
        t, w = time.perf_counter(), time.time()
        try:
            item = wq.take()
        except QueueExhausted:
            break
        if trip:
            rec.append((w, time.perf_counter() - t, item.epoch))
        n += 1
    wq.close()
    out.put((i, n, rec))


def _probe(url: str, stop: Any, out: list[tuple[float, float]], every: float = 0.05) -> None:
    """The reference measured alongside: a one-row INSERT + COMMIT on the same server every 50 ms
    (the commit flush and the CPU share that bound every claim at the moment), through psycopg2."""
    import psycopg2

    u = resolve_url(url)
    conn = psycopg2.connect(host=u.host, port=u.port or 5432, user=u.username, dbname=u.database)
    cur = conn.cursor()
    cur.execute("CREATE TABLE IF NOT EXISTS wq_bench_probe (at timestamptz)")
    conn.commit()
    while not stop.wait(every):
        t, w = time.perf_counter(), time.time()
        cur.execute("INSERT INTO wq_bench_probe VALUES (clock_timestamp())")
        conn.commit()
        out.append((w, time.perf_counter() - t))
    conn.close()


def _in(probe: list[tuple[float, float]], t0: float, t1: float) -> list[float]:
    return [d for w, d in probe if t0 <= w < t1]


_TABLE_STATS = ("SELECT n_live_tup, n_dead_tup, autovacuum_count, autoanalyze_count, last_autovacuum, "
                "pg_relation_size('ix_wq_items_pending') FROM pg_stat_user_tables WHERE relname = 'wq_items'")


def _collect(ps: list[Any], out: Any, eng: Any, pg: bool, every: float = 15.0) -> tuple[list[Any], list[Any]]:
    """Wait for one result per process; meanwhile (Postgres) sample wq_items' vacuum statistics."""
    import queue as _q

    res: list[Any] = []
    samples: list[Any] = []
    t0 = time.time()
    while len(res) < len(ps):
        try:
            res.append(out.get(timeout=every))
        except _q.Empty:
            if any(p.exitcode not in (None, 0) for p in ps):
                raise RuntimeError("a worker process failed") from None
            if pg:
                with eng.connect() as c:
                    row = c.exec_driver_sql(_TABLE_STATS).one()
                samples.append((time.time(), *row[:4]))
                print(f"  {time.time() - t0:6.0f}s  live {row[0]} dead {row[1]} autovacuums {row[2]} "
                      f"autoanalyzes {row[3]}  load {os.getloadavg()[0]:.1f}", flush=True)
    return res, samples


def cmd_drain(a: argparse.Namespace) -> None:
    ctx = mp.get_context("fork")
    pg = a.backend == "postgresql"
    with scratch(a.backend, a.pg, tag="drain") as url:
        t = time.perf_counter()
        WorkQueue([f"part-{i:07d}" for i in range(a.n)], num_epochs=a.epochs, shuffle=True, seed=7, name=QUEUE,
                  url=url, worker="creator").close()
        print(f"# created {a.n} items x {a.epochs} epochs in {time.perf_counter() - t:.1f}s", flush=True)
        eng = sa.create_engine(resolve_url(url))
        if pg:
            print("# server:", server_settings(a.pg), flush=True)
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
        load0 = os.getloadavg()[0]
        import threading

        probe: list[tuple[float, float]] = []
        stop = threading.Event()
        prober = threading.Thread(target=_probe, args=(url, stop, probe), daemon=True)
        if pg:
            prober.start()
        t0 = time.time()
        go.set()
        res, samples = _collect(ps, out, eng, pg)
        stop.set()
        if pg:
            prober.join(10)
        for p in ps:
            p.join(60)
        total = time.time() - t0
        load1 = os.getloadavg()[0]
        stats = {}
        if pg:
            with eng.connect() as c:
                row = c.exec_driver_sql(_TABLE_STATS).one()
                stats = {"n_live_tup": row[0], "n_dead_tup": row[1], "autovacuum_count": row[2],
                         "autoanalyze_count": row[3], "last_autovacuum": row[4], "pending_index_bytes": row[5]}
        eng.dispose()
    rec = sorted(x for _, _, r in res for x in r)
    n = sum(r[1] for r in res)
    print(f"\n## drain {n} items ({a.n} x {a.epochs} epochs) on {a.backend}, {a.procs} workers, lease-ahead "
          f"{a.lease_ahead}, full scan every {a.full_scan_every or 'default'} rounds: {total:.1f}s, "
          f"{n / total:.0f} items/s, load {load0:.1f} at the start, {load1:.1f} at the end\n")
    print("| tenth of the drain | round trips | items/s | p50 ms | p99 ms | probe commit p50 / p99 ms "
          "| claim p50 / probe p50 | autovacuums of wq_items so far |")
    print("|---|---|---|---|---|---|---|---|")
    tenths = []
    for d in range(10):
        part = rec[d * len(rec) // 10:(d + 1) * len(rec) // 10]
        span = part[-1][0] - part[0][0] if len(part) > 1 else float("nan")
        lat = [x[1] for x in part]
        pr = _in(probe, part[0][0], part[-1][0]) if part else []
        tenths.append((lat, pr))
        av = max((s[3] for s in samples if s[0] <= part[-1][0]), default=0) if part and samples else "-"
        print(f"| {d + 1} | {len(part)} | {len(part) * a.lease_ahead / span:.0f} | {pct(lat, 50) * 1e3:.2f} "
              f"| {pct(lat, 99) * 1e3:.2f} | {pct(pr, 50) * 1e3:.2f} / {pct(pr, 99) * 1e3:.2f} "
              f"| {pct(lat, 50) / pct(pr, 50):.2f} | {av} |")
    k = max(1, len(rec) // 10)
    first = [x[1] for x in rec[:k]]
    last = [x[1] for x in rec[-k:]]
    r50 = pct(last, 50) / pct(first, 50)
    r99 = pct(last, 99) / pct(first, 99)
    print(f"\nfirst 10%: p50 {pct(first, 50) * 1e3:.2f} ms p99 {pct(first, 99) * 1e3:.2f} ms; last 10%: "
          f"p50 {pct(last, 50) * 1e3:.2f} ms p99 {pct(last, 99) * 1e3:.2f} ms; ratio p50 {r50:.2f} p99 {r99:.2f} "
          f"(target <= 1.5: {'met' if max(r50, r99) <= 1.5 else 'MISSED'})")
    if probe:
        (fl, fp), (ll, lp) = tenths[0], tenths[-1]
        n50 = (pct(ll, 50) / pct(lp, 50)) / (pct(fl, 50) / pct(fp, 50))
        n99 = (pct(ll, 99) / pct(lp, 99)) / (pct(fl, 99) / pct(fp, 99))
        print(f"normalised by the probe commit measured at the same time: last/first p50 x{n50:.2f}, p99 x{n99:.2f}")
    print("table stats after the drain:", stats, flush=True)
    per_epoch = []
    if a.epochs > 1:
        per_epoch = _per_epoch(rec, a.epochs, a.n, probe)
    dump(a.json, {"n": n, "seconds": total, "first": first, "last": last, "stats": stats, "samples": samples,
                  "per_epoch": per_epoch, "probe": probe})


def _per_epoch(rec: list[tuple[float, float, int]], epochs: int, n: int,
               probe: list[tuple[float, float]]) -> list[dict[str, float]]:
    """Per epoch: p50/p99 of the round trips that returned an item of it, and its duration (from
    its first hand-out to the next epoch's first, or to the last hand-out); with the probe commit
    measured during the same interval (the same-run reference)."""
    starts = {e: min(x[0] for x in rec if x[2] == e) for e in range(epochs)}
    end = max(x[0] + x[1] for x in rec)
    rows = []
    print("\n| epoch | round trips | p50 ms | p99 ms | seconds | items/s | probe commit p50 ms | p50 / probe p50 |")
    print("|---|---|---|---|---|---|---|---|")
    for e in range(epochs):
        lat = [x[1] for x in rec if x[2] == e]
        t1 = starts[e + 1] if e + 1 < epochs else end
        dur = t1 - starts[e]
        pr = pct(_in(probe, starts[e], t1), 50)
        rows.append({"epoch": e, "trips": len(lat), "p50": pct(lat, 50), "p99": pct(lat, 99), "seconds": dur,
                     "probe_p50": pr, "norm": pct(lat, 50) / pr})
        print(f"| {e} | {len(lat)} | {pct(lat, 50) * 1e3:.2f} | {pct(lat, 99) * 1e3:.2f} | {dur:.1f} | {n / dur:.0f} "
              f"| {pr * 1e3:.2f} | {pct(lat, 50) / pr:.2f} |")
    f, la = rows[0], rows[-1]
    mid = rows[1:-1] or rows
    print(f"\nlast / first epoch: p50 x{la['p50'] / f['p50']:.2f}, p99 x{la['p99'] / f['p99']:.2f}, "
          f"duration x{la['seconds'] / f['seconds']:.2f}, p50 / probe x{la['norm'] / f['norm']:.2f}; "
          f"epochs 1..{epochs - 2} (no start-up, no drain tail): p50 x{mid[-1]['p50'] / mid[0]['p50']:.2f}, "
          f"p99 x{mid[-1]['p99'] / mid[0]['p99']:.2f}, duration x{mid[-1]['seconds'] / mid[0]['seconds']:.2f}, "
          f"p50 / probe x{mid[-1]['norm'] / mid[0]['norm']:.2f}; max/min over epochs: p50 "
          f"x{max(r['p50'] for r in rows) / min(r['p50'] for r in rows):.2f}, duration "
          f"x{max(r['seconds'] for r in rows) / min(r['seconds'] for r in rows):.2f}, p50 / probe "
          f"x{max(r['norm'] for r in rows) / min(r['norm'] for r in rows):.2f}", flush=True)
    return rows


# ---------------------------------------------------------------- epoch roll-over


def _raw_epoch(url: str, qid: int, n: int, epoch: int, seed: int) -> None:
    """The rows ``statements.insert_epoch`` writes, through the driver in one transaction (the reference)."""
    from wq_sql.plan import epoch_order

    order = epoch_order(n, epoch, True, seed)
    u = resolve_url(url)
    if u.get_backend_name() == "sqlite":
        import sqlite3

        conn = sqlite3.connect(str(u.database), isolation_level=None, timeout=60)
        cur = conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        cur.executemany("INSERT INTO wq_items (queue_id, epoch, seq, work_idx, state, attempts) "
                        "VALUES (?, ?, ?, ?, 'pending', 0)", ((qid, epoch, s, i) for s, i in enumerate(order)))
        cur.execute("COMMIT")
        conn.close()
        return
    import psycopg2
    from psycopg2.extras import execute_values

    conn = psycopg2.connect(host=u.host, port=u.port or 5432, user=u.username, dbname=u.database)
    cur = conn.cursor()
    execute_values(cur, "INSERT INTO wq_items (queue_id, epoch, seq, work_idx, state, attempts) VALUES %s",
                   ((qid, epoch, s, i, "pending", 0) for s, i in enumerate(order)), page_size=10_000)
    conn.commit()
    conn.close()


def _advance(url: str, qid: int, have: int) -> float:
    """``statements.advance_epoch`` in its own transaction, as ``epochs.EpochMaker.make`` runs it."""
    from wq_sql.store import statements

    eng = sa.create_engine(resolve_url(url))
    try:
        t = time.perf_counter()
        with eng.begin() as c:
            if eng.dialect.name == "sqlite":
                c.exec_driver_sql("SELECT 1")
            made = statements.advance_epoch(c, qid, have)
        dt = time.perf_counter() - t
        assert made == have + 1, made
        return dt
    finally:
        eng.dispose()


def _rollover_child(url: str, name: str, i: int, after: float, ready: Any, go: Any, out: Any,
                    queue_on: bool = True) -> None:
    os.environ[FAIR_ENV] = "1" if queue_on else "0"  # read when the WorkQueue opens its database
    wq = WorkQueue.attach(name, url=url, worker=f"r{i}", lease_ahead=1)
    rec: list[tuple[float, float, int]] = []
    ready.set()
    go.wait()
    crossed = None
    error = ""
    while crossed is None or time.time() - crossed < after:
        t, w = time.perf_counter(), time.time()
        try:
            item = wq.take()
        except QueueExhausted:
            break
        except Exception as e:  # e.g. a statement_timeout while waiting for the epoch's creator
            error = f"take() raised after {time.perf_counter() - t:.1f}s: {type(e).__name__}: {str(e).splitlines()[0]}"
            rec.append((w, time.perf_counter() - t, -1))
            break
        rec.append((w, time.perf_counter() - t, item.epoch))
        if item.epoch >= 1 and crossed is None:
            crossed = time.time()
    with contextlib.suppress(Exception):
        wq.close()
    out.put((i, rec, error))


def _watch_sessions(url: str, stop: Any, seen: list[tuple[float, str]]) -> None:
    """Sample what the workers' backends are doing (the profile of a stall, server side)."""
    eng = sa.create_engine(resolve_url(url))
    db = resolve_url(url).database
    try:
        with eng.connect() as c:
            while not stop.wait(0.2):
                rows = c.exec_driver_sql(
                    "SELECT state, coalesce(wait_event_type || ':' || wait_event, 'on CPU'), left(query, 48) "
                    "FROM pg_stat_activity WHERE datname = %(db)s AND application_name = 'wq_sql' "
                    "AND state = 'active'", {"db": db}).all()
                c.rollback()
                now = time.time()
                seen.extend((now, f"{r[1]} | {' '.join(r[2].split())}") for r in rows)
    finally:
        eng.dispose()


def cmd_rollover(a: argparse.Namespace) -> None:
    from wq_sql.plan import epoch_order

    pg = a.backend == "postgresql"
    variants = ["on"] if pg else {"on": ["on"], "off": ["off"], "ab": ["off", "on"]}[a.writers_queue]
    works = [f"s3://bucket/dataset/part-{i:07d}.parquet" for i in range(a.n)]
    with scratch(a.backend, a.pg, tag="rollover") as url:
        if pg:
            print("# server:", server_settings(a.pg), flush=True)
        times: dict[str, list[float]] = {"wq_sql": [], "raw": []}
        perm, ratio, prof = float("nan"), float("nan"), ""
        if a.create_time:
            # Part 1: the time to create an epoch: statements.advance_epoch vs the same rows through the driver.
            t = time.perf_counter()
            WorkQueue(works, num_epochs=a.repeats + 2, shuffle=True, seed=7, name="ro_wq", url=url,
                      worker="creator").close()
            WorkQueue(works, num_epochs=a.repeats + 1, shuffle=True, seed=7, name="ro_raw", url=url,
                      worker="creator").close()
            qa, qb = queue_id(url, "ro_wq"), queue_id(url, "ro_raw")
            print(f"# two queues of {a.n} works created in {time.perf_counter() - t:.1f}s", flush=True)
            t = time.perf_counter()
            epoch_order(a.n, 1, True, 7)
            perm = time.perf_counter() - t
            for rep in range(a.repeats):
                for m in (["wq_sql", "raw"] if rep % 2 == 0 else ["raw", "wq_sql"]):
                    t = time.perf_counter()
                    if m == "wq_sql":
                        _advance(url, qa, rep + 1)
                    else:
                        _raw_epoch(url, qb, a.n, rep + 1, 7)
                    times[m].append(time.perf_counter() - t)
                    print(f"  create epoch {rep + 1} of {a.n} items, {m:6s}: {times[m][-1]:.2f}s  "
                          f"load {os.getloadavg()[0]:.1f}", flush=True)
            ratio = median([w / r for w, r in zip(times["wq_sql"], times["raw"])])
            if a.profile:  # one more epoch under cProfile: where the creating worker's time goes
                import cProfile
                import io
                import pstats

                pr = cProfile.Profile()
                pr.enable()
                _advance(url, qa, a.repeats + 1)
                pr.disable()
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(18)
                prof = buf.getvalue()
        # Part 2: the stall at the boundary, once per variant of SQLite's writers' queue (A/B, same run).
        stalls = {v: _stall_run(a, url, works, pg, f"rb_{v}" if len(variants) > 1 else "rb", v == "on")
                  for v in variants}
    print(f"\n## epoch roll-over on a {a.n}-work queue ({a.backend})\n")
    if a.create_time:
        print(f"time to create one epoch ({a.n} item rows, one transaction), medians of {a.repeats}:\n")
        print("| variant | seconds | vs raw |")
        print("|---|---|---|")
        print(f"| wq_sql `statements.advance_epoch` | {median(times['wq_sql']):.2f} | {ratio:.2f} |")
        print(f"| raw ({'execute_values' if pg else 'executemany'}) | {median(times['raw']):.2f} | 1.00 |")
        print(f"\nof which `plan.epoch_order` (the shuffle, in Python): {perm:.2f}s")
    if prof:
        print("\ncProfile of one more `statements.advance_epoch` (cumulative):\n" + prof)
    reports = {v: _stall_report(a, *stalls[v], queue_on=v == "on", pg=pg) for v in variants}
    main_v = "on" if "on" in reports else variants[0]
    dump(a.json, {"create": times, "perm": perm, **reports[main_v], "variants": reports})


def _stall_run(a: argparse.Namespace, url: str, works: list[str], pg: bool, name: str,
               queue_on: bool) -> tuple[list[Any], list[tuple[float, str]], float, float]:
    """Epoch 0 all done but its last ``a.tail`` items, epoch 1 made; ``a.procs`` workers drain the
    tail and cross into epoch 1, whose first claim makes epoch 2. ``queue_on``: SQLite's writers'
    queue (``WQ_SQL_SQLITE_FAIR``). Returns each worker's claims, the sampled sessions and the
    load before and after."""
    import threading

    WorkQueue(works, num_epochs=3, shuffle=True, seed=7, name=name, url=url, worker="creator").close()
    qid = queue_id(url, name)
    _advance(url, qid, 1)
    eng = sa.create_engine(resolve_url(url))
    with eng.begin() as c:
        c.execute(sa.text("UPDATE wq_items SET state = 'done' WHERE queue_id = :q AND epoch = 0 AND seq < :s"),
                  {"q": qid, "s": a.n - a.tail})
    with eng.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.exec_driver_sql("VACUUM ANALYZE wq_items" if pg else "ANALYZE")
    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    readies, ps = [], []
    for i in range(a.procs):
        r = ctx.Event()
        p = ctx.Process(target=_rollover_child, args=(url, name, i, a.after, r, go, out, queue_on))
        p.start()
        readies.append(r)
        ps.append(p)
    for r in readies:
        r.wait(120)
    seen: list[tuple[float, str]] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_sessions, args=(url, stop, seen), daemon=True)
    if pg:
        watcher.start()
    load0 = os.getloadavg()[0]
    go.set()
    res = [out.get(timeout=3600) for _ in ps]
    stop.set()
    for p in ps:
        p.join(60)
    if pg:
        watcher.join(10)
    eng.dispose()
    return res, seen, load0, os.getloadavg()[0]


def _stall_report(a: argparse.Namespace, res: list[Any], seen: list[tuple[float, str]], load0: float,
                  load1: float, *, queue_on: bool, pg: bool) -> dict[str, Any]:
    from collections import Counter

    which = "" if pg else f", SQLite writers' queue {'on' if queue_on else 'OFF (WQ_SQL_SQLITE_FAIR=0)'}"
    for i, _, err in res:
        if err:
            print(f"worker {i}: {err}")
    rec = sorted(x for _, r, _ in res for x in r)
    tb = min(x[0] for x in rec if x[2] >= 1 or x[2] < 0)
    ref = [x[1] for x in rec if x[2] == 0]
    around = [x[1] for x in rec if tb - 1.0 <= x[0] <= tb + 1.0]
    after = [x[1] for x in rec if x[0] > tb + 1.0]
    worst = max(rec, key=lambda x: x[1])
    med = pct(ref, 50)
    p99 = pct(around, 99)
    print(f"\nstall at the boundary, {a.procs} workers, lease-ahead 1, last {a.tail} items of epoch 0 then "
          f"{a.after:.0f}s into epoch 1 (whose first claim makes epoch 2){which}, load {load0:.1f} -> "
          f"{load1:.1f}:\n")
    print("| claims | n | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|")
    for label, xs in (("epoch 0, before the boundary (reference)", ref),
                      ("started within 1 s of the first epoch-1 claim", around),
                      ("after that", after)):
        print(f"| {label} | {len(xs)} | {pct(xs, 50) * 1e3:.2f} | {pct(xs, 99) * 1e3:.2f} | "
              f"{max(xs, default=float('nan')) * 1e3:.1f} |")
    per_worker = {i: max((x[1] for x in r if x[0] >= tb - 1.0), default=0.0) for i, r, _ in res}
    wi, wk = next((i, k) for i, r, _ in res for k, x in enumerate(r) if x == worst)
    print(f"\nlongest take() per worker around the boundary: "
          f"{', '.join(f'{v * 1e3:.0f} ms' for _, v in sorted(per_worker.items()))}; the longest of all "
          f"started {worst[0] - tb:+.2f}s from the boundary (worker {wi}'s take() #{wk + 1})")
    verdict = "met" if worst[1] <= 10 * med else "MISSED"
    print(f"p99 around the boundary / median claim: x{p99 / med:.0f}; longest stall / median claim: "
          f"x{worst[1] / med:.0f} (target <= 10: {verdict})")
    if seen:
        print("\nwhat the workers' backends were doing during the longest stall (pg_stat_activity, sampled "
              "every 0.2 s; samples):\n")
        during = Counter(s for t_, s in seen if worst[0] <= t_ <= worst[0] + worst[1])
        for s, k in during.most_common(8):
            print(f"  {k:5d}  {s}")
    print(f"all claims: n {len(rec)}, p99 {pct([x[1] for x in rec], 99) * 1e3:.2f} ms, max {worst[1] * 1e3:.1f} ms")
    # The first worker to stop closes its queue (one write transaction: acks, give-backs, its row)
    # while the others still claim: the claims that ended before it are the roll-over's alone.
    left = min((r[-1][0] + r[-1][1] for _, r, _ in res if r), default=float("inf"))
    while_all = [x for x in rec if x[0] + x[1] <= left]
    worst_all = max(while_all, key=lambda x: x[1], default=(tb, float("nan"), -1))
    print(f"claims that ended before the first worker left ({left - tb:+.2f}s): n {len(while_all)}, p99 "
          f"{pct([x[1] for x in while_all], 99) * 1e3:.2f} ms, max {worst_all[1] * 1e3:.1f} ms "
          f"(started {worst_all[0] - tb:+.2f}s)")
    return {"ref": ref, "around": around, "worst": worst, "per_worker": per_worker, "sessions": seen,
            "loads": [load0, load1], "claims": {i: r for i, r, _ in res},
            "worst_before_leaving": worst_all, "first_left": left - tb}


# ---------------------------------------------------------------- worker memory


def _memory_child(url: str, name: str, items: int, out: Any) -> None:
    import gc

    gc.collect()
    base = rss_mib()
    wq = WorkQueue.attach(name, url=url, worker="mem", lease_ahead=1)
    joined = rss_mib()
    for _ in range(items):
        wq.take()
    after = rss_mib()
    wq.close()
    out.put((base, joined, after, rss_mib("VmHWM")))


def cmd_memory(a: argparse.Namespace) -> None:
    sizes = (1000, a.n)
    ctx = mp.get_context("spawn")
    variants = [("attach", 1)] + ([("rolls the epoch", 2)] if a.rollover else [])
    runs: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    with scratch(a.backend, a.pg, tag="memory") as url:
        for _v, epochs in variants:
            for size in sizes:
                t = time.perf_counter()
                WorkQueue([f"s3://bucket/dataset/part-{i:07d}.parquet" for i in range(size)], num_epochs=epochs,
                          shuffle=True, seed=7, name=f"m{epochs}_{size}", url=url, worker="creator").close()
                print(f"# queue of {size} works, {epochs} epoch(s): {time.perf_counter() - t:.1f}s", flush=True)
        for rep in range(a.repeats):
            for v, epochs in variants:
                for size in (sizes if rep % 2 == 0 else sizes[::-1]):
                    name = f"m{epochs}_{size}_{rep}"
                    clone_queue(url, f"m{epochs}_{size}", name)  # an untouched queue for every worker
                    out = ctx.Queue()
                    p = ctx.Process(target=_memory_child, args=(url, name, a.items, out))
                    p.start()
                    r = out.get(timeout=3600)
                    p.join()
                    runs.setdefault((v, size), []).append(r)
                    print(f"  {a.backend} {v:16s} {size:8d} rep {rep}: RSS after imports {r[0]:.1f}, joined "
                          f"{r[1]:.1f}, after {a.items} items {r[2]:.1f}, peak {r[3]:.1f} MiB", flush=True)
    print(f"\n## worker memory on {a.backend}: a fresh process joins with WorkQueue.attach and takes {a.items} "
          f"items (lease-ahead 1); medians of {a.repeats}\n")
    print("| worker | queue items | RSS after imports MiB | RSS after the items MiB | peak RSS MiB | "
          "peak above imports MiB |")
    print("|---|---|---|---|---|---|")
    for v, _ in variants:
        for size in sizes:
            rs = runs[(v, size)]
            print(f"| {v} | {size} | {median([r[0] for r in rs]):.1f} | {median([r[2] for r in rs]):.1f} "
                  f"| {median([r[3] for r in rs]):.1f} | {median([r[3] - r[0] for r in rs]):.1f} |")
        big, small = runs[(v, a.n)], runs[(v, 1000)]
        ratio = median([b[3] / s[3] for b, s in zip(big, small)])
        extra = median([(b[3] - b[0]) - (s[3] - s[0]) for b, s in zip(big, small)])
        print(f"| {v}: {a.n} vs 1000 | | | | x{ratio:.2f} | {extra:+.1f} |")
    dump(a.json, {f"{v}/{s}": r for (v, s), r in runs.items()})


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["create", "drain", "rollover", "memory"])
    ap.add_argument("--backend", default="postgresql", choices=["sqlite", "postgresql"])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--epochs", type=int, default=1, help="drain: epochs of --n items each")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--lease-ahead", type=int, default=1)
    ap.add_argument("--full-scan-every", type=int, default=0,
                    help="drain: override ClaimRound.FULL_SCAN_EVERY (1 = no floor, the claim before the fix)")
    ap.add_argument("--tail", type=int, default=4000, help="rollover: items of epoch 0 left before the boundary")
    ap.add_argument("--after", type=float, default=5.0, help="rollover: seconds each worker goes on into epoch 1")
    ap.add_argument("--no-create-time", dest="create_time", action="store_false",
                    help="rollover: only the stall at the boundary, not the creation time against raw")
    ap.add_argument("--profile", action="store_true", help="rollover: cProfile one more epoch creation")
    ap.add_argument("--writers-queue", default="on", choices=["on", "off", "ab"],
                    help="rollover, SQLite: with the writers' queue (on), without (off: WQ_SQL_SQLITE_FAIR=0), "
                         "or both in the same run (ab: off, then on)")
    ap.add_argument("--items", type=int, default=300, help="memory: items each worker takes")
    ap.add_argument("--no-rollover", dest="rollover", action="store_false",
                    help="memory: skip the worker whose first claim makes the next epoch")
    ap.add_argument("--quick", action="store_true", help="a smoke run: small sizes, one repeat")
    add_pg_args(ap)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.n, a.repeats = min(a.n, 20_000 if a.what != "drain" else 4_000), 1
        a.tail, a.after, a.items = min(a.tail, 500), min(a.after, 1.0), min(a.items, 50)
    print("#", machine(), "rev", git_rev(), flush=True)
    with pg_server(a) as admin:
        a.pg = admin
        {"create": cmd_create, "drain": cmd_drain, "rollover": cmd_rollover, "memory": cmd_memory}[a.what](a)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
