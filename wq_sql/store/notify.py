"""The doorbell: a waiting ``take()`` is woken by the change it waits for, not by its next poll.

A worker whose ``take()`` finds nothing claimable while other workers hold items waits for one of
a few changes: an item made claimable again (released, failed for a retry, expired, recovered
from a dead worker, given back, requeued), the next epoch's first rows, more epochs, or the end
of the queue. The transaction that makes such a change is followed by :func:`ring` for its queue;
each process that has waiting workers keeps one :class:`Bell` per database, whose thread hears
the rings of every process and wakes the waiting takes of that queue (they then look with one
read-only poll). Polls stay as the safety net, at most every ``poll_seconds`` while the bell is
live (``Bell.live``), at the worker's own pace otherwise (the wait in ``worker/dispenser.py``).

- PostgreSQL: ``NOTIFY`` (``pg_notify``, sent in its own short transaction after the change
  committed) and one ``LISTEN`` connection per process, outside the pool. Behind a pooler in
  transaction mode a ``LISTEN`` hears nothing (the server connection is handed to other
  clients between transactions), so a new listener first proves it hears: it listens on a
  channel of its own, notifies it from a pooled connection, and goes live only if the
  notification arrives; otherwise the process polls as before, and one INFO line says why.
  ``$WQ_SQL_LISTEN_URL`` names a direct URL of the same database for the listener (workers
  behind a pooler then hear rings too, at one server connection per process); a listener that
  finds another server or database there stays off, with a WARNING. A lost listener (restart,
  failover) reconnects with back-off and, once back, wakes every waiter once (a ring may have
  been missed meanwhile).
- SQLite (one host): one Unix datagram socket per process in a folder named after the database
  file, under the temporary folder (``<tmp>/wq_sql-<uid>/<hash of the path>/``); a ring sends
  the queue id to every socket there (a socket no process has open any more is removed).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import select
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from sqlalchemy import Engine, text

from wq_sql.store.dialects import PG_LAZY_COMMIT, sqlite_file
from wq_sql.store.driver import driver_statement
from wq_sql.store.engine import make_engine, resolve_url
from wq_sql.store.redact import safe_url

log = logging.getLogger("wq_sql")

CHANNEL = "wq_sql"        # Postgres: the channel every queue's rings go to (payload: schema.qid)
PROBE_SECONDS = 2.0       # how long a new listener waits for its own probe before it gives up
KEEPALIVE_SECONDS = 10.0  # a quiet listener checks its connection this often
RETRY_MAX = 5.0           # the longest pause between two reconnects of a lost listener

Listener = Callable[[str], None]  # called with the ring's news ("": none, or a reconnect)
NEWS_MAX = 100  # characters of news a ring may carry (a datagram and a NOTIFY payload hold more)


def _payload(engine: Engine, qid: int) -> str:
    """Which queue a ring is for: the queue's schema (``WorkQueue(schema=)``) and id."""
    schema = (engine.get_execution_options().get("schema_translate_map") or {}).get(None)
    return f"{schema or ''}.{qid}"


def notify_args(engine: Engine, qid: int) -> Optional[tuple[str, str]]:
    """Postgres: the channel and the start of the payload (ending in a space, the news to
    follow) for a ring sent by a statement of the caller's own (``poll.Poll.read_ringing``:
    the read that finds the queue finished rings in the same round trip); then call
    :func:`ring` with ``notified=True``. None on SQLite, whose rings are datagrams."""
    if engine.dialect.name == "sqlite":
        return None
    return CHANNEL, _payload(engine, qid) + " "


def ring(engine: Engine, qid: int, news: str = "", *, notified: bool = False) -> None:
    """Tell every process waiting on queue ``qid`` of this database that it may have changed.
    Call it after the change committed. ``news`` (no more than ``NEWS_MAX`` characters) goes to
    the listeners with the ring: what the ringer read after its change, so that a listener need
    not read it again (``Dispenser.heard``: the end of the queue). Best effort: a ring that fails
    is logged at DEBUG (the waiters' polls find the change anyway). ``notified``: a statement
    of the caller's sent the ``NOTIFY`` already (:func:`notify_args`); only this process's own
    waiters remain to be told."""
    assert len(news) <= NEWS_MAX, news
    payload = _payload(engine, qid) + (f" {news}" if news else "")
    try:
        if notified:
            pass
        elif engine.dialect.name == "sqlite":
            path = sqlite_file(engine.url)
            if path is not None:  # a file: an in-memory database has no other process
                _SocketBell.send(path, payload)
        else:
            with driver_statement(engine) as (conn, prefix):  # one round trip, no compile
                cur = conn.cursor()
                try:
                    cur.execute(prefix + PG_LAZY_COMMIT + "SELECT pg_notify(%s, %s)", (CHANNEL, payload))
                finally:
                    cur.close()
    except Exception as e:  # noqa: BLE001 - never let a wake-up fail the change it follows
        log.debug("ring for queue %s not sent: %s", qid, e)
    _local(engine, payload)


def subscribe(engine: Engine, qid: int, fn: Listener) -> Callable[[], None]:
    """Call ``fn`` (from the bell's thread; it must not block) whenever queue ``qid`` rings, and
    once when the bell (re)connects. Returns the function that unsubscribes; :func:`live` says
    whether rings are heard right now. ``WQ_SQL_BELL=0`` in the environment turns the bell off
    (waiting takes poll, as without one)."""
    if os.environ.get("WQ_SQL_BELL") == "0":
        return lambda: None
    key = _key(engine)
    with _lock:
        bell = _bells.get(key)
        if bell is None or bell.pid != os.getpid():
            bell = _bells[key] = (_SocketBell if engine.dialect.name == "sqlite" else _NotifyBell)(engine)
        payload = _payload(engine, qid)
        bell.listeners.setdefault(payload, []).append(fn)
        bell.start()

    def unsubscribe() -> None:
        with _lock:
            fns = bell.listeners.get(payload, [])
            if fn in fns:
                fns.remove(fn)
            if not fns:
                bell.listeners.pop(payload, None)
            if not bell.listeners and _bells.get(key) is bell:
                del _bells[key]
                bell.stop()
    return unsubscribe


def live(engine: Engine) -> bool:
    """Whether this process hears the rings of other processes on this database now."""
    bell = _bells.get(_key(engine))
    return bell is not None and bell.pid == os.getpid() and bell.live


def _key(engine: Engine) -> str:
    path = sqlite_file(engine.url)
    return str(path.resolve()) if path is not None else engine.url.render_as_string(hide_password=False)


def _local(engine: Engine, payload: str) -> None:
    """Same-process waiters, when this process's bell is not live (it hears its own rings when it
    is): called from a thread of their own, never the ringer's, which may hold a queue object's
    lock that a listener takes (``Dispenser.heard``)."""
    bell = _bells.get(_key(engine))
    if bell is not None and bell.pid == os.getpid() and not bell.live:
        threading.Thread(target=bell.dispatch, args=(payload,), name="wq_sql-bell-local", daemon=True).start()


class _Bell:
    """One process's ear on one database: a thread that hears rings (this process's own too)
    and calls the listeners."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pid = os.getpid()
        self.listeners: dict[str, list[Listener]] = {}
        self.live = False
        self._thread: Optional[threading.Thread] = None
        self._wake_r, self._wake_w = socket.socketpair()  # stop() wakes the thread's select()
        self._wake_w.setblocking(False)
        self._stopped = False

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="wq_sql-bell", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self.live = False
        with contextlib.suppress(OSError):  # already closed: the thread ended by itself
            self._wake_w.send(b"x")

    def dispatch(self, payload: Optional[str]) -> None:
        """Call the listeners of ``payload``'s queue with its news (``None``: of every queue,
        with none)."""
        key, _, news = (payload or "").partition(" ")
        with _lock:
            fns = ([f for fs in self.listeners.values() for f in fs] if payload is None
                   else list(self.listeners.get(key, ())))
        for fn in fns:
            try:
                fn(news)
            except Exception:  # noqa: BLE001 - one listener's bug must not deafen the others
                log.exception("wq_sql bell listener failed")

    def _run(self) -> None:
        try:
            self.listen()
        finally:
            self.live = False
            self._wake_r.close()
            self._wake_w.close()

    def listen(self) -> None:
        raise NotImplementedError


class _SocketBell(_Bell):
    """SQLite: a datagram socket of this process in the database's bell folder."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        path = sqlite_file(engine.url)
        assert path is not None
        self.folder = self.folder_of(path)
        self.where = self.folder / f"{self.pid}-{os.urandom(3).hex()}"

    def stop(self) -> None:
        super().stop()
        self._leave()  # now, not when the thread gets to it: the process may be exiting

    def _leave(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.where)
        with contextlib.suppress(OSError):
            self.folder.rmdir()  # the last one out (not empty: another process listens)

    @staticmethod
    def folder_of(path: Path) -> Path:
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:20]
        return Path(tempfile.gettempdir()) / f"wq_sql-{os.getuid()}" / digest

    @classmethod
    def send(cls, path: Path, payload: str) -> None:
        folder = cls.folder_of(path)
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return  # nobody listens
        data = payload.encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            for name in names:
                where = str(folder / name)
                try:
                    s.sendto(data, socket.MSG_DONTWAIT, where)
                except (ConnectionRefusedError, FileNotFoundError):
                    with contextlib.suppress(OSError):
                        os.unlink(where)  # its process is gone
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.ENOBUFS):  # full: it has rings to read
                        log.debug("ring to %s not sent: %s", where, e)

    def listen(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for _attempt in range(3):
            try:
                self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
                sock.bind(str(self.where))
                break
            except FileNotFoundError:  # the last one out removed the folder meanwhile
                continue
            except OSError as e:
                sock.close()
                log.info("wq_sql: no doorbell in %s (%s): waiting takes poll the database", self.folder, e)
                return
        else:
            sock.close()
            return
        try:
            self.live = True
            self.dispatch(None)  # rings sent before the socket existed
            while not self._stopped:
                ready, _, _ = select.select([sock, self._wake_r], [], [])
                if sock in ready:
                    while True:
                        try:
                            data = sock.recv(256, socket.MSG_DONTWAIT)
                        except BlockingIOError:
                            break
                        self.dispatch(data.decode(errors="replace"))
        finally:
            self.live = False
            sock.close()
            self._leave()


class _NotifyBell(_Bell):
    """Postgres: ``LISTEN`` on one connection of this process, outside the engine's pool (or
    on ``$WQ_SQL_LISTEN_URL``'s)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.via = engine
        direct = os.environ.get("WQ_SQL_LISTEN_URL")
        if direct:
            self.via = make_engine(resolve_url(direct), pool_size=1)

    def listen(self) -> None:
        try:
            self._listen()
        finally:
            if self.via is not self.engine:
                self.via.dispose()

    def _listen(self) -> None:
        pause = 0.5
        while not self._stopped:
            conn = None
            try:
                if self.via is not self.engine and not self._same_database():
                    return
                conn = self._connect()
                if conn is None:
                    log.info("wq_sql: LISTEN hears nothing on %s (a pooler in transaction mode? "
                             "$WQ_SQL_LISTEN_URL can name a direct URL): waiting takes poll the "
                             "database", safe_url(self.via.url))
                    return
                self.live = True
                pause = 0.5
                self.dispatch(None)  # a ring may have been missed while not listening
                self._hear(conn)
            except Exception as e:  # noqa: BLE001 - lost: reconnect, the polls cover meanwhile
                self.live = False
                log.debug("wq_sql bell on %s lost (%s); reconnecting", safe_url(self.via.url), e)
                self._sleep(pause)
                pause = min(2 * pause, RETRY_MAX)
            finally:
                self.live = False
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()

    def _sleep(self, seconds: float) -> None:
        select.select([self._wake_r], [], [], seconds)

    def _same_database(self) -> bool:
        """Whether ``$WQ_SQL_LISTEN_URL`` reaches the workers' database (same database name and
        server start time, seen through both URLs); False with a WARNING if not."""
        q = text("SELECT current_database(), pg_postmaster_start_time()")
        with self.engine.connect() as a, self.via.connect() as b:
            ours, theirs = a.execute(q).one(), b.execute(q).one()
        if tuple(ours) != tuple(theirs):
            log.warning("wq_sql: $WQ_SQL_LISTEN_URL (%s) reaches another database than the workers' "
                        "url (%s); the doorbell is off, waiting takes poll", safe_url(self.via.url),
                        safe_url(self.engine.url))
            self._stopped = True
            return False
        return True

    def _connect(self) -> Any:
        """A listening connection that was proven to hear, or None (a transaction pooler)."""
        # A new connection, not the pool's idle one: that one has the claim round planned
        # (ClaimRound.warm), and taking it made the pool open another for the next round, which
        # paid to connect and to plan it again. recreate(): the same connect
        # arguments and events, in a pool of its own, from which the connection is detached.
        fairy = self.via.pool.recreate().connect()
        fairy.detach()  # ours: closed when this bell is done with it
        conn: Any = fairy.dbapi_connection
        try:
            conn.autocommit = True
            probe = f"{CHANNEL}_probe_{os.getpid()}_{os.urandom(4).hex()}"
            with conn.cursor() as cur:
                cur.execute(f'LISTEN "{probe}"')
            with self.via.connect() as other, other.begin():
                other.execute(text("SELECT pg_notify(:c, '')"), {"c": probe})
            deadline = time.monotonic() + PROBE_SECONDS
            heard = False
            while not heard and time.monotonic() < deadline and not self._stopped:
                select.select([conn], [], [], max(0.0, deadline - time.monotonic()))
                conn.poll()
                heard = any(n.channel == probe for n in conn.notifies)
                conn.notifies.clear()
            with conn.cursor() as cur:
                cur.execute(f'UNLISTEN "{probe}"')
                if not heard:
                    conn.close()
                    return None
                cur.execute(f'LISTEN "{CHANNEL}"')
            return conn
        except BaseException:
            with contextlib.suppress(Exception):
                conn.close()
            raise

    def _hear(self, conn: Any) -> None:
        while not self._stopped:
            ready, _, _ = select.select([conn, self._wake_r], [], [], KEEPALIVE_SECONDS)
            if not ready:
                with conn.cursor() as cur:  # a quiet connection may be dead: find out
                    cur.execute("SELECT 1")
                continue
            if self._wake_r in ready:
                return
            conn.poll()
            got = {n.payload for n in conn.notifies if n.channel == CHANNEL}
            conn.notifies.clear()
            for payload in got:
                self.dispatch(payload)


_lock = threading.RLock()
_bells: dict[str, _Bell] = {}


def _after_fork_in_child() -> None:
    """The parent's bells and their threads are not this process's: forget them (their
    connections are the parent's; psycopg2 does not close a connection a fork inherited)."""
    global _lock
    _lock = threading.RLock()
    _bells.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
