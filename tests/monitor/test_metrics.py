"""``wq-sql metrics`` as a real process, scraped over HTTP while real worker processes drain a
queue: every figure equals the SQL count of the same moment (the workers are stopped with
SIGSTOP for each comparison, so nothing changes between the scrape and the counts)."""

from __future__ import annotations

import datetime as dt
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from watch_support import (  # noqa: E402
    create_queue,
    database_away,
    pause,
    start_server,
    start_worker,
    stop,
    wait_exhausted,
)
from worker_proc import query  # noqa: E402

parser = pytest.importorskip("prometheus_client.parser")

N, EPOCHS, POISON_EVERY = 120, 2, 10
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(address: str) -> Samples:
    with urllib.request.urlopen(address, timeout=30) as r:
        assert r.status == 200
        body = r.read().decode()
    out: Samples = {}
    for fam in parser.text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def pick(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def sql_counts(url: str) -> dict[str, Any]:
    """The same figures, counted from the rows with plain SQL over the views."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as c:
            states = Counter({(int(e), s): int(n) for e, s, n in c.execute(sa.text(
                "SELECT epoch, state, count(*) FROM wq_audit WHERE queue = 'train' GROUP BY epoch, state"))})
            kinds = Counter({(int(e), k): int(n) for e, k, n in c.execute(sa.text(
                "SELECT epoch, kind, count(*) FROM wq_history WHERE queue = 'train' GROUP BY epoch, kind"))})
            done_by = dict(c.execute(sa.text(  # type: ignore[arg-type]
                "SELECT worker, count(*) FROM wq_audit WHERE queue = 'train' AND state = 'done' "
                "GROUP BY worker")).all())
            held_by = dict(c.execute(sa.text(  # type: ignore[arg-type]
                "SELECT worker, count(*) FROM wq_audit WHERE queue = 'train' AND state = 'claimed' "
                "GROUP BY worker")).all())
            oldest = c.execute(sa.text(
                "SELECT min(claimed_at) FROM wq_audit WHERE queue = 'train' AND state = 'claimed'")).scalar()
            # Every pending row, not the first in claim order as the exporter reads it.
            pending = c.execute(sa.text(
                "SELECT min(i.pending_since) FROM wq_items i JOIN wq_queues q ON q.id = i.queue_id "
                "WHERE q.name = 'train' AND i.state = 'pending'")).scalar()
    finally:
        engine.dispose()
    return {"states": states, "kinds": kinds, "done_by": done_by, "held_by": held_by, "oldest": oldest,
            "pending": pending}


def age_of(stamp: Any) -> float:
    if isinstance(stamp, str):
        stamp = dt.datetime.fromisoformat(stamp)
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.timezone.utc)
    return (dt.datetime.now(dt.timezone.utc) - stamp).total_seconds()


def check(samples: Samples, sql: dict[str, Any], epochs: list[int]) -> None:
    states, kinds = sql["states"], sql["kinds"]
    for e in epochs:
        def at(name: str, **labels: str) -> float:
            return pick(samples, name, queue="train", epoch=str(e), **labels)  # noqa: B023 - used at once

        for state in ("pending", "claimed", "done", "failed"):
            assert at("wq_sql_items", state=state) == states[(e, state)], (e, state)
        assert at("wq_sql_deliveries_total") == kinds[(e, "claim")] + kinds[(e, "recover")], e
        ended_not_done = sum(kinds[(e, k)] for k in ("release", "fail", "expire", "recover"))
        sent_back = ended_not_done - states[(e, "failed")]
        assert at("wq_sql_redeliveries_total") == sent_back, e
        assert at("wq_sql_failures_total", kind="error") == kinds[(e, "fail")], e
        assert at("wq_sql_failures_total", kind="worker_restarted") == kinds[(e, "recover")], e
        assert (at("wq_sql_expired_leases_total") + at("wq_sql_failures_total", kind="worker_gone")
                == kinds[(e, "expire")]), e
    done = series(samples, "wq_sql_worker_items_done_total")
    assert {dict(k)["worker"]: v for k, v in done.items() if v} == sql["done_by"]
    held = series(samples, "wq_sql_worker_items_held")
    assert {dict(k)["worker"]: v for k, v in held.items() if v} == sql["held_by"]
    for metric, stamp in (("wq_sql_oldest_delivery_age_seconds", sql["oldest"]),
                          ("wq_sql_oldest_pending_age_seconds", sql["pending"])):
        age = pick(samples, metric, queue="train")
        if stamp is None:
            assert age == 0, metric
        else:
            assert abs(age - age_of(stamp)) < 5, (metric, age, age_of(stamp))
    assert pick(samples, "wq_sql_up") == 1


def test_metrics_equal_sql_counts_while_workers_drain(db_url: str, tmp_path: Path) -> None:
    create_queue(db_url, tmp_path, "train", N, epochs=EPOCHS, poison_every=POISON_EVERY)
    exporter, address = start_server("metrics", "--url", db_url, "--port", "0", "--per-worker",
                                     "--window", "5", tmp_path=tmp_path)
    workers = [start_worker(db_url, "train", f"w{k}", 40, tmp_path) for k in range(3)]
    try:
        first = scrape(address)
        assert pick(first, "wq_sql_items_per_epoch", queue="train") == N
        assert pick(first, "wq_sql_epochs", queue="train") == EPOCHS
        compared = 0
        seen_claimed = 0.0
        deadline = time.monotonic() + 120
        while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
            time.sleep(0.7)
            pause(workers, True, db_url)
            try:
                samples = scrape(address)
                sql = sql_counts(db_url)
                check(samples, sql, sorted({e for e, _ in sql["states"]}))
                compared += 1
                seen_claimed = max(seen_claimed, sum(series(samples, "wq_sql_worker_items_held").values()))
            finally:
                pause(workers, False)
        for w in workers:
            wait_exhausted(w)
        assert compared >= 2, "the drain was too fast to compare mid-way"
        assert seen_claimed > 0, "never saw an item in flight"
        final = scrape(address)
        sql = sql_counts(db_url)
        check(final, sql, list(range(EPOCHS)))
        poisoned = N // POISON_EVERY
        for e in range(EPOCHS):
            assert pick(final, "wq_sql_items", queue="train", epoch=str(e), state="failed") == poisoned
            assert pick(final, "wq_sql_items", queue="train", epoch=str(e), state="done") == N - poisoned
            # each poisoned item: delivered twice, failed twice, sent back once
            assert pick(final, "wq_sql_deliveries_total", queue="train", epoch=str(e)) == N + poisoned
            assert pick(final, "wq_sql_redeliveries_total", queue="train", epoch=str(e)) == poisoned
            assert pick(final, "wq_sql_failures_total", queue="train", epoch=str(e),
                        kind="error") == 2 * poisoned
        assert pick(final, "wq_sql_workers", queue="train", state="closed") == 3
        assert pick(final, "wq_sql_eta_seconds", queue="train") == 0
        # Their loops' waits for an item (watch_support measures them), as each worker's close wrote.
        waits = series(final, "wq_sql_worker_input_wait_seconds_total")
        written = dict(query(db_url, "SELECT name, input_wait FROM wq_workers"))
        assert {dict(k)["worker"]: v for k, v in waits.items()} == pytest.approx(written)
        assert all(v > 0 for v in written.values()), written
    finally:
        stop(workers)
        stop([exporter])


def test_metrics_top_k_bounds_the_worker_series(db_url: str, tmp_path: Path) -> None:
    """Without --per-worker only stragglers get series, at most --top-k of them: 4 workers, none
    judged yet (younger than the window), so none has a series; the queue's figures are there."""
    create_queue(db_url, tmp_path, "train", 20)
    exporter, address = start_server("metrics", "--url", db_url, "--port", "0", "--top-k", "2",
                                     tmp_path=tmp_path)
    workers = [start_worker(db_url, "train", f"w{k}", 5, tmp_path) for k in range(4)]
    try:
        for w in workers:
            wait_exhausted(w)
        samples = scrape(address)
        assert not series(samples, "wq_sql_worker_items_done_total")
        assert pick(samples, "wq_sql_items", queue="train", epoch="0", state="done") == 20
        assert pick(samples, "wq_sql_stragglers", queue="train") == 0
        assert pick(samples, "wq_sql_workers", queue="train", state="closed") == 4
    finally:
        stop(workers)
        stop([exporter])


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_metrics_report_an_outage_and_recover(db_url: str, tmp_path: Path) -> None:
    """A database that goes away makes a scrape say wq_sql_up 0 instead of failing; once it is
    back the figures return."""
    create_queue(db_url, tmp_path, "train", 5)
    exporter, address = start_server("metrics", "--url", db_url, "--port", "0", tmp_path=tmp_path)
    try:
        assert pick(scrape(address), "wq_sql_up") == 1
        with database_away(db_url) as back:
            for _ in range(2):  # still away: still 0, the exporter still answers
                down = scrape(address)
                assert pick(down, "wq_sql_up") == 0
                assert not series(down, "wq_sql_items")
            back()
            up = scrape(address)
            assert pick(up, "wq_sql_up") == 1
            assert pick(up, "wq_sql_items", queue="train", epoch="0", state="pending") == 5
    finally:
        stop([exporter])


def test_oldest_pending_age_counts_from_when_the_rows_were_made(db_url: str) -> None:
    """The age of the oldest pending item grows from when its epoch's rows were written, a
    requeue keeps it (as a message queue's age counts from the enqueue), a new epoch's rows
    start their own, and a queue with nothing pending reads 0."""
    from wq_sql import WorkQueue
    from wq_sql.monitor.metrics import QueueCollector
    from wq_sql.store.engine import make_engine, resolve_url

    engine = make_engine(resolve_url(db_url))

    def age() -> float:
        views = QueueCollector(engine, queues=["aging"]).read()
        return views[0].oldest_pending_age or 0.0

    wq = WorkQueue([f"w{i}" for i in range(4)], num_epochs=2, shuffle=False, url=db_url, worker="a",
                   lease_ahead=1, name="aging")
    try:
        time.sleep(1.2)
        first = wq.take()  # epoch 0's rows were made with the queue
        assert 1.1 <= age() < 30
        wq.release(first)  # back to pending: it keeps its time
        assert age() >= 1.1
        for _ in range(5):  # epoch 0 handed out, and the first item of epoch 1, made now
            wq.take()
        assert age() < 1.0
        time.sleep(1.2)
        assert age() >= 1.1
        for _ in range(3):
            wq.take()
        assert age() == 0  # nothing pending
    finally:
        wq.close()
        engine.dispose()
    views = QueueCollector(make_engine(resolve_url(db_url)), queues=["aging"]).read()
    assert views[0].oldest_pending_age is None  # all done: nothing pending
