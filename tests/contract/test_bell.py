"""The doorbell (``wq_sql/notify.py``): a take waiting for other workers' items is woken by the
change it waits for, rung by the process that made it, not found by its next poll. Shared over
both backends (and PgBouncer, where LISTEN hears nothing: the wait polls, as before)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import sqlalchemy as sa
from backends import POOLED

from wq_sql import QueueEmpty, QueueExhausted, WorkQueue
from wq_sql.store import notify
from wq_sql.store.engine import make_engine
from wq_sql.store.hot.poll import Peek

# A waiter whose polls come this rarely can only have been woken by a ring in these tests.
SLOW_POLLS = 60.0


def _waiter(url: str, name: str, out: Any) -> None:
    wq = WorkQueue.attach(name, url=url, worker=f"waiter-{os.getpid()}", poll_seconds=SLOW_POLLS)
    got = []
    try:
        while True:
            got.append(wq.take())
            out.put(("took", time.time(), wq._d.rings))
    except QueueExhausted:
        out.put(("end", time.time(), wq._d.rings, got))
    finally:
        wq.close()


def _start_waiter(url: str, name: str) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_waiter, args=(url, name, out), daemon=True)
    p.start()
    return p, out


def _held_queue(url: str, name: str, items: list[str]) -> WorkQueue:
    """A queue whose every item the returned worker holds."""
    WorkQueue(items, name=name, url=url, worker="creator").close()
    holder = WorkQueue.attach(name, url=url, worker="holder", lease_ahead=len(items), claim_ahead=False)
    for _ in items:
        holder.take()
    return holder


def _wait_until_waiting(url: str, name: str, seconds: float = 60) -> None:
    """Until the waiter joined and its bell is live (it subscribes at its first wait)."""
    engine = sa.create_engine(url)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with engine.connect() as c:
                n = c.execute(sa.text("SELECT count(*) FROM wq_workers w JOIN wq_queues q ON q.id = "
                                      "w.queue_id WHERE q.name = :n AND w.name LIKE 'waiter-%'"),
                              {"n": name}).scalar()
            if n:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the waiter never joined")
    finally:
        engine.dispose()
    time.sleep(3.0)  # its first polls back off; a live bell (probe included) is up long before


def test_the_end_of_the_queue_wakes_a_waiting_take_in_another_process(db_url: str, backend: str) -> None:
    holder = _held_queue(db_url, "end", ["a", "b"])
    p, out = _start_waiter(db_url, "end")
    try:
        _wait_until_waiting(db_url, "end")
        t = time.time()
        with pytest.raises(QueueExhausted):
            holder.take()  # acknowledges the last item: the queue is finished
        kind, at, rings, got = out.get(timeout=SLOW_POLLS / 2)
        assert kind == "end" and got == []
        if backend == POOLED:  # LISTEN hears nothing through a transaction pooler: it polled
            assert rings == 0
        else:
            assert rings >= 1, "the waiter was not woken by a ring"
            assert at - t < 10, f"woken {at - t:.1f}s after the end"
    finally:
        holder.close()
        p.join(30)
        p.kill()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
def test_a_ring_that_says_the_queue_is_finished_ends_a_wait_without_a_poll(db_url: str, backend: str) -> None:
    """The worker whose acknowledgement finished the queue rings with what it read: a waiting
    take ends on that news, as its own poll would have ended it, without the poll. Here every
    poll of the waiter says the queue is far from finished, so only the news can end it."""
    holder = _held_queue(db_url, "news", ["a", "b"])
    # No heartbeat during the test: a poll that rides on its renewal is a real read.
    waiter = WorkQueue.attach("news", url=db_url, worker="waiter", poll_seconds=SLOW_POLLS,
                              lease_seconds=1200, heartbeat_seconds=600)
    d = waiter._d
    polls: list[int] = []

    def lying_poll(*args: Any) -> Peek:
        polls.append(1)
        return Peek(pending=False, expired=False, finished=0, epochs_created=1, mine=0, failed=0,
                    num_epochs=1)

    d.hot.poll = lying_poll  # type: ignore[method-assign]
    ended: list[BaseException] = []

    def wait() -> None:
        try:
            waiter.take(timeout=SLOW_POLLS / 2)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            ended.append(e)

    t = threading.Thread(target=wait)
    t.start()
    try:
        _until(lambda: d.waiting == 1 and notify.live(waiter.engine),
               "the take never waited with a live bell")
        with pytest.raises(QueueExhausted):
            holder.take()  # acknowledges the last item: the queue is finished, and it rings
        t.join(SLOW_POLLS)
        assert ended and isinstance(ended[0], QueueExhausted), ended
        assert (ended[0].done, ended[0].failed) == (2, 0)
        assert d.end_heard is not None and d.end_heard[1].finished == 2
    finally:
        holder.close()
        waiter.close()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_take_that_may_wait_hears_rings_before_the_end_one_that_never_waits_does_not(
        db_url: str, backend: str) -> None:
    """Workers that share a queue subscribe to the bell once it is expected to run dry within
    ``handout.LISTEN_AHEAD``, so the listener is up before the waits at the end (not made by
    each of them at once); a consumer whose takes never wait (``timeout=0``, as
    ``wq_sql.torch``'s) opens none."""
    WorkQueue([f"w{i}" for i in range(300)], name="early", url=db_url, worker="creator").close()
    waiting = [WorkQueue.attach("early", url=db_url, worker=f"a{i}") for i in range(2)]
    never = WorkQueue.attach("early", url=db_url, worker="never")
    heard_at_wait: list[bool] = []

    def watch(d: Any) -> None:
        wait = d._wait

        def first(*args: Any) -> None:
            heard_at_wait.append(d._deafen is not None)
            return wait(*args)
        d._wait = first

    def run(wq: WorkQueue, timeout: Optional[float]) -> None:
        try:
            while True:
                wq.take_many(1, timeout)
                time.sleep(0.002)
        except (QueueExhausted, QueueEmpty):
            pass

    for wq in waiting:
        watch(wq._d)
    threads = [threading.Thread(target=run, args=(wq, None)) for wq in waiting]
    threads.append(threading.Thread(target=run, args=(never, 0)))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert never._d._deafen is None, "a take that never waits subscribed to the bell"
        assert heard_at_wait and all(heard_at_wait), heard_at_wait
    finally:
        for wq in (*waiting, never):
            wq.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
def test_an_item_given_back_wakes_a_waiting_take_in_another_process(db_url: str, backend: str) -> None:
    holder = _held_queue(db_url, "back", ["a"])
    p, out = _start_waiter(db_url, "back")
    try:
        _wait_until_waiting(db_url, "back")
        t = time.time()
        holder.release("a")
        kind, at, rings = out.get(timeout=SLOW_POLLS / 2)[:3]
        assert kind == "took" and at - t < 10, (kind, at - t)
        assert rings >= 1, "the waiter was not woken by a ring"
    finally:
        holder.close()
        p.join(30)
        p.kill()


def test_a_ring_reaches_every_process_and_skips_dead_ones(tmp_path: Path) -> None:
    """SQLite's bell: one datagram socket per process in the database's folder; a socket whose
    process was SIGKILLed is removed by the next ring, and a ring with nobody listening is a
    no-op."""
    url = f"sqlite:///{tmp_path / 'q.db'}"
    engine = sa.create_engine(url)
    folder = notify._SocketBell.folder_of(tmp_path / "q.db")
    notify.ring(engine, 1)  # nobody listens yet: nothing happens
    heard: list[str] = []
    stop = notify.subscribe(engine, 1, lambda news: heard.append(news))
    try:
        deadline = time.monotonic() + 10
        while not notify.live(engine) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert notify.live(engine)
        # A dead process's socket: bound, then its owner gone without unlinking it.
        dead = folder / "999999999-dead"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(str(dead))
        s.close()
        ctx = mp.get_context("fork")
        child = ctx.Process(target=notify.ring, args=(engine, 1, "end 3 0 1"))
        child.start()
        child.join(30)
        deadline = time.monotonic() + 10
        while "end 3 0 1" not in heard and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "end 3 0 1" in heard, "the ring from another process was not heard with its news"
        assert not dead.exists(), "a dead process's socket was left"
    finally:
        stop()
        engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_the_postgres_listener_comes_back_after_its_connection_is_killed(db_url: str, backend: str) -> None:
    engine = sa.create_engine(db_url)
    heard: list[int] = []
    stop = notify.subscribe(engine, 7, lambda news: heard.append(1))
    try:
        _until(lambda: notify.live(engine), "the listener never went live")
        with engine.connect() as c, c.begin():
            killed = c.execute(sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE pid <> "
                "pg_backend_pid() AND datname = current_database() AND query LIKE 'LISTEN%'")).scalar()
        assert killed == 1
        _until(lambda: not notify.live(engine), "the lost listener still says it is live")
        _until(lambda: notify.live(engine), "the listener never came back")
        heard.clear()
        notify.ring(engine, 7)
        _until(lambda: bool(heard), "a ring after the reconnect was not heard")
    finally:
        stop()
        engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_the_postgres_listener_opens_its_own_connection_and_leaves_the_pools_idle_one(
        db_url: str, backend: str) -> None:
    """The pool's idle connection is the one whose server backend has the claim round planned
    (``ClaimRound.warm``): the listener must not take it away (the pool then opened a new one,
    which planned the round again)."""
    engine = make_engine(sa.engine.make_url(db_url))
    fairy = engine.raw_connection()
    idle = fairy.dbapi_connection
    fairy.close()
    stop = notify.subscribe(engine, 7, lambda news: None)
    try:
        _until(lambda: notify.live(engine), "the listener never went live")
        assert engine.pool.checkedin() == 1 and engine.pool.checkedout() == 0
        fairy = engine.raw_connection()
        try:
            assert fairy.dbapi_connection is idle
        finally:
            fairy.close()
        with engine.connect() as c:
            listening = c.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                                          "current_database() AND query LIKE 'LISTEN%'")).scalar()
        assert listening == 1
    finally:
        stop()
        engine.dispose()


@pytest.mark.parametrize("backend", [POOLED], indirect=True)
def test_behind_pgbouncer_a_direct_listen_url_brings_the_bell_back(db_url: str, backend: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    direct = sa.engine.make_url(db_url).set(host="127.0.0.1", port=sa.engine.make_url(
        os.environ["WQ_SQL_TEST_PG"]).port or 5432)
    monkeypatch.setenv("WQ_SQL_LISTEN_URL", direct.render_as_string(hide_password=False))
    holder = _held_queue(db_url, "end", ["a"])
    p, out = _start_waiter(db_url, "end")  # spawned: it inherits $WQ_SQL_LISTEN_URL
    try:
        _wait_until_waiting(db_url, "end")
        t = time.time()
        with pytest.raises(QueueExhausted):
            holder.take()
        kind, at, rings, _ = out.get(timeout=SLOW_POLLS / 2)
        assert kind == "end" and rings >= 1, "the waiter behind PgBouncer was not woken by a ring"
        assert at - t < 10
    finally:
        holder.close()
        p.join(30)
        p.kill()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_listen_url_of_another_database_is_refused_with_a_warning(
        db_url: str, backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("WQ_SQL_LISTEN_URL", sa.engine.make_url(db_url).set(database="postgres")
                       .render_as_string(hide_password=False))
    _assert_bell_stays_off(db_url, caplog, "WARNING", "reaches another database")


@pytest.mark.parametrize("backend", [POOLED], indirect=True)
def test_through_pgbouncer_the_bell_stays_off_and_says_why(db_url: str, backend: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    _assert_bell_stays_off(db_url, caplog, "INFO", "LISTEN hears nothing")


def _assert_bell_stays_off(url: str, caplog: pytest.LogCaptureFixture, level: str, says: str) -> None:
    """A listener on ``url`` logs ``says`` at ``level`` and never goes live."""
    engine = sa.create_engine(url)
    stop = notify.subscribe(engine, 3, lambda news: None)
    try:
        with caplog.at_level(level, logger="wq_sql"):
            _until(lambda: says in caplog.text, f"no {level} line saying {says!r}")
        assert not notify.live(engine)
    finally:
        stop()
        engine.dispose()


def _until(cond: Any, message: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, message
        time.sleep(0.02)


def test_sigkill_of_a_listening_process_leaves_the_others_hearing(tmp_path: Path) -> None:
    """The socket of a SIGKILLed waiter stays in the folder; rings skip it (and remove it), and
    the live waiter still wakes."""
    url = f"sqlite:///{tmp_path / 'q.db'}"
    holder = _held_queue(url, "k", ["a"])
    victim, _ = _start_waiter(url, "k")
    p, out = _start_waiter(url, "k")
    try:
        _wait_until_waiting(url, "k")
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        with pytest.raises(QueueExhausted):
            holder.take()
        kind, at, rings, _ = out.get(timeout=SLOW_POLLS / 2)
        assert kind == "end" and rings >= 1
        folder = notify._SocketBell.folder_of(tmp_path / "q.db")
        left = os.listdir(folder) if folder.exists() else []  # the last one out removes it
        assert not any(n.startswith(f"{victim.pid}-") for n in left)
    finally:
        holder.close()
        p.join(30)
        p.kill()
