"""``wq-sql dashboard``: a small read-only web page that watches the queues as a job runs.

Served by the standard library (``ThreadingHTTPServer``), three GET routes:

* ``/``: the page (``dashboard.html`` beside this module), whose script polls the state and
  redraws with ``textContent`` only (a work or an error can never become markup);
* ``/api/state``: JSON from :mod:`wq_sql.monitor.snapshot`: per queue the epochs (progress, rate, ETA), the
  workers sorted by rate with stragglers marked, the failures of the last ``minutes``;
* ``/api/timeline.svg?queue=NAME``: ``report.render_svg`` of the last ``minutes``.

While the database is unreachable ``/api/state`` answers ``{"ok": false, "error": ..., "down_since":
...}`` and the page shows the outage over the last figures it had; the next answer that works
clears it (the engine drops a broken connection and opens a new one). The URL on the page has
its password hidden (``safe_url``), errors pass ``mask_secrets``, and as a last guard no response
body carries the password's text.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Callable, Optional
from urllib.parse import parse_qs, urlsplit

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from wq_sql.monitor import report, snapshot
from wq_sql.store import statements
from wq_sql.store.dialects import dialect_of
from wq_sql.store.engine import first_line
from wq_sql.store.redact import mask_secrets

log = logging.getLogger("wq_sql")

DEFAULT_PORT = 8464
REFRESH_SECONDS = 2.0
TIMELINE_REFRESH_SECONDS = 5.0
MAX_FAILURES = 20


class Watcher:
    """What the routes serve, read through one engine; remembers the current outage."""

    def __init__(self, engine: Engine, label: str, *, queue: Optional[str] = None, minutes: float = 10.0,
                 window: float = snapshot.WINDOW_SECONDS, password: Optional[str] = None) -> None:
        self.engine = engine
        self.label = label
        self.queue = queue
        self.minutes = minutes
        self.window = window
        self.password = password
        self.down_since: Optional[float] = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- reads

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"database": self.label, "refresh_seconds": REFRESH_SECONDS,
                               "timeline_refresh_seconds": TIMELINE_REFRESH_SECONDS, "minutes": self.minutes,
                               "window_seconds": self.window,
                               "straggler_fraction": snapshot.STRAGGLER_FRACTION}
        try:
            out.update(snapshot.snapshot(self.engine, self._read))
        except SQLAlchemyError as e:
            return self._outage(out, e)
        with self._lock:
            if self.down_since is not None:
                log.warning("dashboard: the database is back after %.0f s", time.time() - self.down_since)
            self.down_since = None
        out["ok"] = True
        return out

    def _outage(self, out: dict[str, Any], e: SQLAlchemyError) -> dict[str, Any]:
        with self._lock:
            if self.down_since is None:
                self.down_since = time.time()
                log.warning("dashboard: the database is unreachable: %s",
                            mask_secrets(first_line(getattr(e, "orig", None) or e)))
            since = self.down_since
        out.update(ok=False, error=mask_secrets(first_line(getattr(e, "orig", None) or e)),
                   down_since=dt.datetime.fromtimestamp(since, dt.timezone.utc).isoformat(),
                   down_seconds=round(time.time() - since, 1))
        return out

    def _queues(self, conn: Connection) -> list[Any]:
        return [q for q in statements.all_queues(conn) if self.queue is None or q.name == self.queue]

    def _read(self, conn: Connection) -> dict[str, Any]:
        d = dialect_of(conn)
        now = d.db_now(conn)
        queues = []
        for q in self._queues(conn):
            v = snapshot.read_queue(conn, d, q, window=self.window)
            events = snapshot.recent_history(conn, q, now, self.minutes, kinds=snapshot.FAILURE_EVENTS,
                                          in_flight=False)
            queues.append(_queue_json(v, snapshot.failures(events, MAX_FAILURES), self.window))
        return {"now": now.isoformat(), "queues": queues}

    def timeline_svg(self, name: str) -> Optional[str]:
        def read(conn: Connection) -> Optional[str]:
            q = statements.find_queue(conn, name)
            if q is None or (self.queue is not None and name != self.queue):
                return None
            now = dialect_of(conn).db_now(conn)
            events = snapshot.recent_history(conn, q, now, self.minutes)
            workers = statements.workers
            lanes = [r.name for r in conn.execute(
                workers.select().where(workers.c.queue_id == q.id).order_by(workers.c.name))]
            finished = sum(statements.progress(conn, q.id)) >= q.n_works * q.num_epochs
            return report.render_svg(snapshot.timeline_of(q, events, lanes, now, self.minutes, finished))
        return snapshot.snapshot(self.engine, read)

    def scrub(self, body: str) -> bytes:
        """The last guard: no response carries the password's text (safe_url and mask_secrets
        already hid it wherever wq_sql shows a URL or an error)."""
        if self.password and len(self.password) >= 4:
            body = body.replace(self.password, "***")
        return body.encode("utf-8")


def _queue_json(v: snapshot.QueueView, fails: list[snapshot.Failure], window: float) -> dict[str, Any]:
    rate = v.rate or 0.0
    share, waiters = snapshot.waiting_on_data(v.workers)
    epochs = []
    left_before = 0
    for e in v.epochs:
        left = e.pending + e.claimed
        left_before += left
        epochs.append({"epoch": e.epoch, "pending": e.pending, "claimed": e.claimed, "done": e.done,
                       "failed": e.failed, "quarantined": e.quarantined, "total": v.n_works,
                       "finished": e.done + e.failed + e.quarantined,
                       "eta_seconds": (left_before / rate if rate else None) if left else 0.0})
    return {
        "name": v.name, "items_per_epoch": v.n_works, "num_epochs": v.num_epochs,
        "epochs_created": v.epochs_created, "epochs": epochs,
        "total": v.total, "finished": v.finished, "rate": rate, "recent_done": v.recent,
        "eta_seconds": v.eta_seconds, "oldest_delivery_age": v.oldest_delivery_age,
        "oldest_pending_age": v.oldest_pending_age, "median_rate": v.median_rate,
        "input_wait_share": share,
        "most_waiting": None if not waiters else {"name": waiters[0].name,
                                                  "share": waiters[0].input_wait_share},
        "workers": [{"name": w.name, "host": w.host, "pid": w.pid, "live": w.live, "stale": w.stale,
                     "heartbeat_age": w.heartbeat_age, "done": w.done, "failed": w.failed, "held": w.held,
                     "recent": w.recent, "rate": w.rate, "straggler": w.straggler,
                     "input_wait": w.input_wait, "input_wait_share": w.input_wait_share}
                    for w in snapshot.by_rate(v.workers)],
        "failures": [{"epoch": f.epoch, "seq": f.seq, "kind": f.kind, "worker": f.worker,
                      "at": f.at.isoformat(), "error": mask_secrets(f.error or "")} for f in fails],
    }


def page() -> str:
    return resources.files("wq_sql.monitor").joinpath("dashboard.html").read_text("utf-8")


def make_handler(w: Watcher) -> type[BaseHTTPRequestHandler]:
    html = page()

    class Handler(BaseHTTPRequestHandler):
        server_version = "wq-sql-dashboard"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            log.debug("dashboard: " + format, *args)

        def _send(self, status: int, ctype: str, body: str) -> None:
            data = w.scrub(body)
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            if parts.path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, "text/html; charset=utf-8", html)
            elif parts.path == "/api/state":
                self._send(HTTPStatus.OK, "application/json", json.dumps(w.state()))
            elif parts.path == "/api/timeline.svg":
                name = parse_qs(parts.query).get("queue", [""])[0]
                try:
                    svg = w.timeline_svg(name)
                except SQLAlchemyError as e:
                    why = mask_secrets(first_line(getattr(e, "orig", None) or e))
                    self._send(HTTPStatus.SERVICE_UNAVAILABLE, "text/plain; charset=utf-8",
                               "database unreachable: " + why)
                    return
                if svg is None:
                    self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", f"no queue {name!r}")
                else:
                    self._send(HTTPStatus.OK, "image/svg+xml", svg)
            else:
                self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", "not found")

        def _read_only(self) -> None:
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, "text/plain; charset=utf-8", "read-only")

        do_POST = do_PUT = do_DELETE = do_PATCH = _read_only

    return Handler


def serve(engine: Engine, label: str, *, host: str, port: int, queue: Optional[str] = None,
          minutes: float = 10.0, window: float = snapshot.WINDOW_SECONDS,
          ready: Optional[Callable[[str], None]] = None) -> None:
    """Serve the dashboard on ``host:port`` until interrupted; ``ready(url)`` once listening."""
    w = Watcher(engine, label, queue=queue, minutes=minutes, window=window, password=engine.url.password)
    server = ThreadingHTTPServer((host, port), make_handler(w))
    server.daemon_threads = True
    try:
        if ready is not None:
            ready(f"http://{host}:{server.server_port}/")
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
