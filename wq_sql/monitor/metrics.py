"""``wq-sql metrics``: a Prometheus exporter computed from the database at each scrape, so one
exporter covers every worker on every machine (``pip install 'wq_sql[metrics]'``).

The figures are :mod:`wq_sql.monitor.snapshot`'s read model; ``prometheus_client`` encodes and serves them
(a custom collector, no state of its own but the history sums, see ``snapshot.HistoryCounts``).
The metric list is in the README ("Metrics"). Label cardinality stays bounded: per queue and
epoch, and per worker only for the ``top_k`` slowest stragglers unless ``per_worker`` is set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from wq_sql.monitor import snapshot
from wq_sql.store import statements
from wq_sql.store.dialects import dialect_of
from wq_sql.store.engine import first_line
from wq_sql.store.redact import mask_secrets

log = logging.getLogger("wq_sql")

try:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("wq-sql metrics needs prometheus-client: pip install 'wq_sql[metrics]'") from e

DEFAULT_PORT = 9464
DEFAULT_TOP_K = 5


class QueueCollector(Collector):
    """Reads every queue (or those named) in one snapshot per scrape."""

    def __init__(self, engine: Engine, *, queues: Sequence[str] = (), per_worker: bool = False,
                 top_k: int = DEFAULT_TOP_K, window: float = snapshot.WINDOW_SECONDS) -> None:
        self.engine = engine
        self.queues = list(queues)
        self.per_worker = per_worker
        self.top_k = top_k
        self.window = window
        self.history = snapshot.HistoryCounts()
        self._lock = threading.Lock()  # one scrape at a time: the history sums are shared

    def read(self) -> list[snapshot.QueueView]:
        def fn(conn: Any) -> list[snapshot.QueueView]:
            d = dialect_of(conn)
            counts = self.history.read(conn)
            rows = [q for q in statements.all_queues(conn) if not self.queues or q.name in self.queues]
            return [snapshot.read_queue(conn, d, q, window=self.window,
                                     history={e: c for (qid, e), c in counts.items() if qid == q.id})
                    for q in rows]
        with self._lock:
            return snapshot.snapshot(self.engine, fn)

    def collect(self) -> Iterator[Metric]:
        began = time.perf_counter()
        up = GaugeMetricFamily("wq_sql_up", "1 if the database answered the last scrape, else 0")
        try:
            views = self.read()
        except SQLAlchemyError as e:  # unreachable, restarting, a pool timeout: the scrape says so
            log.warning("scrape failed: %s", mask_secrets(first_line(getattr(e, "orig", None) or e)))
            up.add_metric([], 0)
            yield up
            return
        yield from self.families(views)
        up.add_metric([], 1)
        yield up
        took = GaugeMetricFamily("wq_sql_scrape_duration_seconds",
                                 "time this scrape spent reading the database")
        took.add_metric([], time.perf_counter() - began)
        yield took

    def families(self, views: list[snapshot.QueueView]) -> Iterator[Metric]:
        q_ = ["queue"]
        qe = ["queue", "epoch"]
        per_epoch = GaugeMetricFamily("wq_sql_items_per_epoch", "items in each epoch", labels=q_)
        epochs = GaugeMetricFamily("wq_sql_epochs", "epochs the queue will run (num_epochs)", labels=q_)
        created = GaugeMetricFamily("wq_sql_epochs_created", "epochs whose item rows are all made", labels=q_)
        items = GaugeMetricFamily("wq_sql_items", "items of an epoch (with rows) by state",
                                  labels=qe + ["state"])
        deliv = CounterMetricFamily("wq_sql_deliveries",
                                    "deliveries of items to workers (ended or in flight)", labels=qe)
        redeliv = CounterMetricFamily(
            "wq_sql_redeliveries", "items sent back for another delivery (released, failed with attempts "
            "left, lease expired, holder gone or restarted)", labels=qe)
        expired = CounterMetricFamily("wq_sql_expired_leases", "deliveries whose lease ran out", labels=qe)
        fails = CounterMetricFamily(
            "wq_sql_failures", "deliveries that ended with an attempt counted, by kind: error (fail()), "
            "lease_expired, worker_gone (heartbeat stopped or process dead), worker_restarted",
            labels=qe + ["kind"])
        oldest = GaugeMetricFamily("wq_sql_oldest_delivery_age_seconds",
                                   "age of the oldest delivery in flight (0: none)", labels=q_)
        pending_age = GaugeMetricFamily(
            "wq_sql_oldest_pending_age_seconds", "age of the oldest pending item, from when it was made "
            "claimable (its epoch's rows written; a requeue keeps it) (0: none pending)", labels=q_)
        rate = GaugeMetricFamily("wq_sql_done_items_per_second", f"items done per second over the last "
                                 f"{self.window:g} s", labels=q_)
        eta = GaugeMetricFamily("wq_sql_eta_seconds", "seconds until every item of every epoch is done or "
                                "failed at the recent rate (absent: no recent rate)", labels=q_)
        workers = GaugeMetricFamily("wq_sql_workers", "workers by state: live, stale (missed heartbeats), "
                                    "closed", labels=q_ + ["state"])
        strag = GaugeMetricFamily("wq_sql_stragglers", "live workers slower than "
                                  f"{snapshot.STRAGGLER_FRACTION:g} x the median rate", labels=q_)
        qw = ["queue", "worker"]
        w_done = CounterMetricFamily("wq_sql_worker_items_done", "items done by the worker", labels=qw)
        w_failed = CounterMetricFamily("wq_sql_worker_items_failed", "items failed for good in its hands",
                                       labels=qw)
        w_rate = GaugeMetricFamily("wq_sql_worker_done_items_per_second",
                                   f"items done per second over the last {self.window:g} s", labels=qw)
        w_beat = GaugeMetricFamily("wq_sql_worker_heartbeat_age_seconds", "seconds since its last heartbeat",
                                   labels=qw)
        w_held = GaugeMetricFamily("wq_sql_worker_items_held", "items it has claimed now", labels=qw)
        w_strag = GaugeMetricFamily("wq_sql_worker_straggler", "1 if the worker is a straggler", labels=qw)
        w_wait = CounterMetricFamily("wq_sql_worker_input_wait_seconds", "seconds its training loop waited "
                                     "for data (the shims measure it), as of its last heartbeat", labels=qw)
        waiting = GaugeMetricFamily("wq_sql_input_wait_share", "share of the live training loops' running "
                                    "time spent waiting for data (absent: none measures it)", labels=q_)
        worst = GaugeMetricFamily("wq_sql_input_wait_worst_share", "the largest share of one live training "
                                  "loop's running time spent waiting for data", labels=q_)
        for v in views:
            per_epoch.add_metric([v.name], v.n_works)
            epochs.add_metric([v.name], v.num_epochs)
            created.add_metric([v.name], v.epochs_created)
            for e in v.epochs:
                labels = [v.name, str(e.epoch)]
                for state, n in (("pending", e.pending), ("claimed", e.claimed), ("done", e.done),
                                 ("failed", e.failed), ("quarantined", e.quarantined)):
                    items.add_metric(labels + [state], n)
                c = v.history.get(e.epoch, Counter())
                deliv.add_metric(labels, snapshot.deliveries(c, e.claimed))
                redeliv.add_metric(labels, snapshot.redeliveries(c, e.failed))
                expired.add_metric(labels, c["lease_expired"])
                for kind in snapshot.FAILURE_KINDS:
                    fails.add_metric(labels + [kind], c[kind])
            oldest.add_metric([v.name], v.oldest_delivery_age or 0.0)
            pending_age.add_metric([v.name], v.oldest_pending_age or 0.0)
            rate.add_metric([v.name], v.rate or 0.0)
            if v.eta_seconds is not None:
                eta.add_metric([v.name], v.eta_seconds)
            live = [w for w in v.workers if w.live]
            stale = sum(1 for w in live if w.stale)
            closed = len(v.workers) - len(live)
            for state, n in (("live", len(live) - stale), ("stale", stale), ("closed", closed)):
                workers.add_metric([v.name, state], n)
            slow = snapshot.stragglers(v.workers)
            strag.add_metric([v.name], len(slow))
            shown = v.workers if self.per_worker else slow[:self.top_k]
            share, waiters = snapshot.waiting_on_data(v.workers)
            if share is not None:
                waiting.add_metric([v.name], share)
                worst.add_metric([v.name], waiters[0].input_wait_share or 0.0)
            # Per worker: the workers shown, and the top k most waiting ones.
            named = {w.name for w in shown}
            for w in shown + [w for w in waiters[:self.top_k] if w.name not in named]:
                if w.input_wait is not None:
                    w_wait.add_metric([v.name, w.name], w.input_wait)
            for w in shown:
                labels = [v.name, w.name]
                w_done.add_metric(labels, w.done)
                w_failed.add_metric(labels, w.failed)
                w_rate.add_metric(labels, w.rate if w.rate is not None else w.recent / self.window)
                if w.heartbeat_age is not None:
                    w_beat.add_metric(labels, w.heartbeat_age)
                w_held.add_metric(labels, w.held)
                w_strag.add_metric(labels, 1 if w.straggler else 0)
        yield from (per_epoch, epochs, created, items, deliv, redeliv, expired, fails, oldest, pending_age,
                    rate, eta, workers, strag, w_done, w_failed, w_rate, w_beat, w_held, w_strag, w_wait,
                    waiting, worst)


def serve(engine: Engine, *, host: str, port: int, queues: Sequence[str] = (), per_worker: bool = False,
          top_k: int = DEFAULT_TOP_K, window: float = snapshot.WINDOW_SECONDS,
          ready: Optional[Any] = None) -> None:
    """Serve ``/metrics`` on ``host:port`` until interrupted; ``ready(url)`` once listening."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(QueueCollector(engine, queues=queues, per_worker=per_worker, top_k=top_k,
                                     window=window))
    server, thread = start_http_server(port, addr=host, registry=registry)
    try:
        if ready is not None:
            ready(f"http://{host}:{server.server_port}/metrics")
        while thread.is_alive():
            thread.join(1.0)
    finally:
        server.shutdown()
