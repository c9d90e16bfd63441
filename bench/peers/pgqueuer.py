"""A real peer on the same Postgres, in the same run: pgqueuer draining N no-op jobs versus wq_sql
draining N items, at equal worker process counts and equal batch size.

* ``pgqueuer``: N jobs enqueued in one call; P processes each run
  ``QueueManager(...).run(mode=drain, batch_size=b)`` with a no-op entrypoint (asyncpg driver,
  pgqueuer's defaults otherwise: it batches completions in a buffer and deletes finished jobs
  into its log table).
* ``wq_sql``: a queue of N items; P processes ``take()`` until ``QueueExhausted`` with
  ``lease_ahead=b``.

Wall time = from the moment every process is connected and ready until the last one exits
(drained). Items/s = N / wall time. Medians of ``--repeats``; every run in a fresh database.

    .venv/bin/pip install pgqueuer asyncpg
    .venv/bin/python bench/peers/pgqueuer.py --procs 1,2,4 --batch 1,32 --n 10000
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import PG_ADMIN, dump, git_rev, machine, median, scratch  # noqa: E402

from wq_sql import QueueExhausted, WorkQueue  # noqa: E402
from wq_sql.store.engine import resolve_url  # noqa: E402


def _dsn(url: str) -> str:
    u = resolve_url(url)
    return f"postgresql://{u.username}@{u.host}:{u.port or 5432}/{u.database}"


async def _pgq_setup(url: str, n: int) -> None:
    import asyncpg
    from pgqueuer import Queries

    conn = await asyncpg.connect(_dsn(url))
    q = Queries.from_asyncpg_connection(conn)
    await q.install()
    for k in range(0, n, 10_000):
        m = min(10_000, n - k)
        await q.enqueue(["noop"] * m, [None] * m, [0] * m)
    await conn.close()


def _pgq_worker(url: str, batch: int, ready: Any, go: Any, out: Any) -> None:
    async def run() -> int:
        import asyncpg
        from pgqueuer import Queries, QueueManager
        from pgqueuer.domain.types import QueueExecutionMode

        conn = await asyncpg.connect(_dsn(url))
        qm = QueueManager(Queries.from_asyncpg_connection(conn))
        done = 0

        @qm.entrypoint("noop")
        async def noop(job: Any) -> None:
            nonlocal done
            done += 1

        ready.set()
        while not go.is_set():
            await asyncio.sleep(0.001)
        await qm.run(mode=QueueExecutionMode.drain, batch_size=batch)
        await conn.close()
        return done

    out.put(asyncio.run(run()))


def _wq_worker(url: str, batch: int, i: int, ready: Any, go: Any, out: Any) -> None:
    wq = WorkQueue.attach("peer", url=url, worker=f"p{i}", lease_ahead=batch)
    ready.set()
    go.wait()
    n = 0
    while True:
        try:
            wq.take()
        except QueueExhausted:
            break
        n += 1
    wq.close()
    out.put(n)


def run_once(system: str, procs: int, batch: int, n: int, admin: str) -> float:
    ctx = mp.get_context("fork")
    with scratch("postgresql", admin, tag="peer") as url:
        if system == "pgqueuer":
            asyncio.run(_pgq_setup(url, n))
        else:
            WorkQueue([f"job-{i:07d}" for i in range(n)], num_epochs=1, shuffle=False, seed=1, name="peer",
                      url=url, worker="creator").close()
        go, out = ctx.Event(), ctx.Queue()
        readies, ps = [], []
        for i in range(procs):
            r = ctx.Event()
            args = (url, batch, r, go, out) if system == "pgqueuer" else (url, batch, i, r, go, out)
            p = ctx.Process(target=_pgq_worker if system == "pgqueuer" else _wq_worker, args=args)
            p.start()
            readies.append(r)
            ps.append(p)
        for r in readies:
            r.wait(120)
        t0 = time.perf_counter()
        go.set()
        got = [out.get(timeout=1800) for _ in ps]
        for p in ps:
            p.join(60)
        wall = time.perf_counter() - t0
        assert sum(got) == n, (system, got, n)
    return n / wall


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pg", default=PG_ADMIN)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import pgqueuer

    print("#", machine(), "rev", git_rev(), "pgqueuer", pgqueuer.__version__, flush=True)
    runs: list[dict[str, Any]] = []
    for rep in range(a.repeats):
        for p in [int(x) for x in a.procs.split(",")]:
            for b in [int(x) for x in a.batch.split(",")]:
                order = ["wq_sql", "pgqueuer"] if rep % 2 == 0 else ["pgqueuer", "wq_sql"]
                for s in order:
                    rate = run_once(s, p, b, a.n if b > 1 else max(1, a.n // 5), a.pg)
                    runs.append({"system": s, "procs": p, "batch": b, "rep": rep, "rate": rate})
                    print(f"  P={p} batch={b} {s:8s} rep {rep}: {rate:8.0f} items/s", flush=True)
    print(f"\n## wq_sql vs pgqueuer, medians of {a.repeats} runs ({a.n} jobs at batch > 1, {a.n // 5} at batch 1)\n")
    print("| procs | batch | wq_sql items/s | pgqueuer items/s | wq_sql / pgqueuer | target | verdict |")
    print("|---|---|---|---|---|---|---|")
    for p in sorted({r["procs"] for r in runs}):
        for b in sorted({r["batch"] for r in runs}):
            w = [r for r in runs if r["procs"] == p and r["batch"] == b and r["system"] == "wq_sql"]
            q = [r for r in runs if r["procs"] == p and r["batch"] == b and r["system"] == "pgqueuer"]
            ratio = median([x["rate"] / y["rate"] for x, y in zip(w, q)])
            print(f"| {p} | {b} | {median([x['rate'] for x in w]):.0f} | {median([x['rate'] for x in q]):.0f} "
                  f"| {ratio:.2f} | > 1 | {'met' if ratio > 1 else 'MISSED'} |")
    dump(a.json, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
