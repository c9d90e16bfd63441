"""How long one ``wq-sql metrics`` scrape takes on a queue of a million items (issue 19).

Makes a queue of ``--n`` items (default 1,000,000) and puts it mid-drain with plain SQL: the
first ``--done`` items done by 16 workers (their ``claim`` and ``done`` history rows and their
counters, as the claim round writes them), 64 items claimed, the workers heartbeating. Then
times the exporter's collector (``metrics.QueueCollector``, encoding included, as a scrape does):
the first scrape (it reads the history once), then ``--scrapes`` more. The reference, in the
same run: the naive way, counting the item rows by state and the history by kind (full scans).
``--drainers N`` runs N worker processes draining the queue meanwhile (scrapes under write load).
Then the dashboard's two reads: ``/api/state`` and the timeline picture (``dashboard.Watcher``).

    python bench/watch_scrape.py --backend sqlite
    python bench/watch_scrape.py --backend postgresql --drainers 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from typing import Any

import sqlalchemy as sa
from _common import PG_ADMIN, ROOT, machine, median, pct, scratch

from wq_sql import WorkQueue
from wq_sql.monitor.dashboard import Watcher
from wq_sql.monitor.metrics import QueueCollector
from wq_sql.store import statements
from wq_sql.store.engine import make_engine
from wq_sql.store.models import UTCDateTime

WORKERS = 16
CLAIMED = 64

DRAINER = """
import sys
from wq_sql import QueueExhausted, WorkQueue
wq = WorkQueue.attach("big", url=sys.argv[1], worker=sys.argv[2], lease_ahead=8)
try:
    while True:
        wq.take()
except QueueExhausted:
    pass
"""


def populate(url: str, n: int, done: int) -> None:
    t0 = time.perf_counter()
    WorkQueue([f"w{i:07d}" for i in range(n)], name="big", url=url, shuffle=True, seed=1,
              worker="creator").close()
    print(f"  created {n} items in {time.perf_counter() - t0:.1f}s", flush=True)
    engine = make_engine(sa.engine.make_url(url), pool_size=1)
    i, w, e, t = statements.items, statements.workers, statements.events, statements.tallies
    now = dt.datetime.now(dt.timezone.utc)
    at = sa.literal(now, UTCDateTime())
    with engine.begin() as c:
        qid = c.execute(sa.select(statements.queues.c.id).where(statements.queues.c.name == "big")).scalar_one()
        c.execute(sa.insert(w), [{"queue_id": qid, "name": f"worker{k:02d}", "incarnation": "x", "host": "bench",
                                  "pid": 1, "started_at": now - dt.timedelta(minutes=10), "heartbeat_at": now,
                                  "beat_seconds": 5.0} for k in range(WORKERS)])
        ids = [r.id for r in c.execute(sa.select(w.c.id).where(w.c.queue_id == qid, w.c.name != "creator")
                                       .order_by(w.c.id))]
        base = ids[0]
        c.execute(sa.update(i).where(i.c.queue_id == qid, i.c.seq < done)
                  .values(state="done", worker_id=base + i.c.seq % WORKERS, token=i.c.seq + 1, claimed_at=at,
                          done_at=at))
        c.execute(sa.update(i).where(i.c.queue_id == qid, i.c.seq >= done, i.c.seq < done + CLAIMED)
                  .values(state="claimed", worker_id=base + i.c.seq % WORKERS, token=i.c.seq + 1, claimed_at=at,
                          lease_until=sa.literal(now + dt.timedelta(hours=1), UTCDateTime())))
        for kind in ("claim", "done"):
            sel = sa.select(i.c.queue_id, i.c.id, i.c.epoch, i.c.seq, sa.literal(kind), i.c.worker_id, i.c.token, at,
                            sa.null()).where(i.c.queue_id == qid, i.c.seq < done).order_by(i.c.seq)
            c.execute(sa.insert(e).from_select(["queue_id", "item_id", "epoch", "seq", "kind", "worker_id", "token",
                                                "at", "detail"], sel))
        sel = sa.select(i.c.queue_id, i.c.epoch, i.c.worker_id, sa.func.count(), sa.literal(0)).where(
            i.c.queue_id == qid, i.c.state == "done").group_by(i.c.queue_id, i.c.epoch, i.c.worker_id)
        c.execute(sa.insert(t).from_select(["queue_id", "epoch", "worker_id", "n_done", "n_failed"], sel))
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(sa.text("VACUUM ANALYZE"))
    engine.dispose()
    print(f"  populated in {time.perf_counter() - t0:.1f}s", flush=True)


def naive(engine: sa.Engine) -> None:
    with engine.connect() as c:
        c.execute(sa.text("SELECT epoch, state, count(*) FROM wq_items GROUP BY epoch, state")).all()
        c.execute(sa.text("SELECT epoch, kind, count(*) FROM wq_events GROUP BY epoch, kind")).all()


def run(backend: str, a: argparse.Namespace) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry, generate_latest

    with scratch(backend, a.pg, "watch") as url:
        populate(url, a.n, a.done)
        engine = make_engine(sa.engine.make_url(url), pool_size=1)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(QueueCollector(engine))
        drainers = [subprocess.Popen([sys.executable, "-c", DRAINER, url, f"drainer{k}"],
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
                    for k in range(a.drainers)]
        try:
            if drainers:
                time.sleep(3)  # let them join and claim
            t0 = time.perf_counter()
            body = generate_latest(registry)
            first = time.perf_counter() - t0
            times = []
            for _ in range(a.scrapes):
                t0 = time.perf_counter()
                body = generate_latest(registry)
                times.append(time.perf_counter() - t0)
                time.sleep(a.pause)
            watcher = Watcher(engine, "bench", minutes=10)
            states, svgs = [], []
            for _ in range(5):
                t0 = time.perf_counter()
                assert watcher.state()["ok"]
                states.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert watcher.timeline_svg("big")
                svgs.append(time.perf_counter() - t0)
            refs = []
            for _ in range(3):
                t0 = time.perf_counter()
                naive(engine)
                refs.append(time.perf_counter() - t0)
        finally:
            for p in drainers:
                p.kill()
                p.wait()
        load = os.getloadavg()
        engine.dispose()
    out = {"backend": backend, "n": a.n, "done": a.done, "drainers": a.drainers,
           "first_scrape_s": round(first, 4), "scrape_median_s": round(median(times), 4),
           "scrape_p90_s": round(pct(times, 90), 4), "naive_count_median_s": round(median(refs), 4),
           "scrape_over_naive": round(median(times) / median(refs), 4), "bytes": len(body),
           "dashboard_state_median_s": round(median(states), 4),
           "dashboard_timeline_median_s": round(median(svgs), 4),
           "loadavg_after": [round(x, 2) for x in load]}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--done", type=int, default=400_000)
    ap.add_argument("--scrapes", type=int, default=15)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds between scrapes")
    ap.add_argument("--drainers", type=int, default=0)
    ap.add_argument("--pg", default=PG_ADMIN)
    a = ap.parse_args()
    print(json.dumps({"machine": machine(), "loadavg_before": os.getloadavg()}), flush=True)
    for b in (["sqlite", "postgresql"] if a.backend == "both" else [a.backend]):
        run(b, a)


if __name__ == "__main__":
    main()
