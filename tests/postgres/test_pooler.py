"""wq_sql through PgBouncer in transaction mode with a plain URL: the timeouts hold in every
transaction and never leak to the pooler's other clients, psycopg 3 prepares nothing, and no
lock outlives its transaction. Each test starts its own PgBouncer with ONE server connection, so
every client shares the same server session and any session state would show.

The contract suite (claims, leases, crashes, epochs, reads) runs through the session's PgBouncer
as the ``pgbouncer`` backend (``conftest.CONTRACT_MODULES``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest
import sqlalchemy as sa
from backends import bouncer_url, drop_pg_database, new_pg_database

from wq_sql import WorkQueue
from wq_sql.store.driver import driver_statement, driver_transaction, last_rows
from wq_sql.store.engine import make_engine, resolve_url


@pytest.fixture
def one_conn_bouncer(pgbouncer: Any, pg_template: str) -> Iterator[tuple[Any, str]]:
    """A PgBouncer of its own with a server pool of 1, and a fresh migrated database behind it."""
    from pgbouncer import PgBouncer

    name = new_pg_database(pg_template)
    host, port = pgbouncer.server
    try:
        with PgBouncer(host, port, pool_size=1, user=pgbouncer.user) as b:
            yield b, bouncer_url(b, name)
    finally:
        drop_pg_database(name)


def _raw_show(url: str, setting: str) -> str:
    """``SHOW setting`` from a plain psycopg2 client in autocommit mode (no transaction)."""
    u = resolve_url(url)
    conn = psycopg2.connect(host=u.host, port=u.port, dbname=u.database, user=u.username)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(f"SHOW {setting}")
            return str(cur.fetchone()[0])
    finally:
        conn.close()


def test_timeouts_hold_in_each_transaction_and_leak_to_no_other_client(
        one_conn_bouncer: tuple[Any, str]) -> None:
    bouncer, url = one_conn_bouncer
    default = _raw_show(url, "statement_timeout")
    with WorkQueue([f"w{i}" for i in range(40)], num_epochs=2, url=url, worker="a", name="leak") as wq:
        assert sum(1 for _ in wq) == 80
    engine = make_engine(resolve_url(url), statement_timeout=7.0)
    try:
        with engine.begin() as c:  # the SQLAlchemy path (heartbeats, polls, epochs)
            assert c.exec_driver_sql("SHOW statement_timeout").scalar() == "7s"
            assert c.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar() == "7s"
        with driver_transaction(engine) as raw:  # the claim round's path
            cur = raw.cursor()
            cur.execute("SHOW statement_timeout")
            assert cur.fetchone()[0] == "7s"
            cur.execute("SELECT count(*) FROM wq_items")  # more statements in the same transaction
            assert cur.fetchone()[0] == 80
            cur.close()
        with driver_transaction(engine) as raw:  # and again on the same pooled connection
            cur = raw.cursor()
            cur.execute("SHOW idle_in_transaction_session_timeout")
            assert cur.fetchone()[0] == "7s"
            cur.close()
        with driver_statement(engine) as (raw, prefix):  # the claim round's one query
            cur = raw.cursor()
            cur.execute(prefix + "SELECT current_setting('statement_timeout')")
            assert last_rows(cur) == [("7s",)]
            cur.close()
    finally:
        engine.dispose()
    # The single server session behind the pooler still has the server's defaults.
    assert _raw_show(url, "statement_timeout") == default
    assert _raw_show(url, "idle_in_transaction_session_timeout") == default
    assert bouncer.show("pools")  # the console answers: the bouncer ran all along


def test_statement_timeout_is_enforced_through_pgbouncer(one_conn_bouncer: tuple[Any, str]) -> None:
    _, url = one_conn_bouncer
    engine = make_engine(resolve_url(url), statement_timeout=0.3)
    try:
        with pytest.raises(sa.exc.OperationalError, match="statement timeout"), engine.begin() as c:
            c.exec_driver_sql("SELECT pg_sleep(3)")
        with pytest.raises(sa.exc.DBAPIError, match="statement timeout"), driver_transaction(engine) as raw:
            raw.cursor().execute("SELECT pg_sleep(3)")
        with pytest.raises(sa.exc.DBAPIError, match="statement timeout"), \
                driver_statement(engine) as (raw, prefix):
            raw.cursor().execute(prefix + "SELECT pg_sleep(3)")
        with engine.begin() as c:  # the connection is usable afterwards
            assert c.exec_driver_sql("SELECT 1").scalar() == 1
    finally:
        engine.dispose()


def test_psycopg3_url_prepares_nothing(one_conn_bouncer: tuple[Any, str]) -> None:
    """psycopg 3 prepares a statement on its 5th execution by default; two clients sharing one
    server connection would then both create ``_pg3_0``. wq_sql's engines never prepare."""
    _, url = one_conn_bouncer
    url3 = resolve_url(url).set(drivername="postgresql+psycopg")
    engines = [make_engine(url3, pool_size=1) for _ in range(2)]
    errors: list[BaseException] = []

    def hammer(engine: sa.Engine) -> None:
        try:
            for i in range(30):
                with engine.begin() as c:
                    assert c.execute(sa.text("SELECT :i + 1"), {"i": i}).scalar() == i + 1
                with driver_transaction(engine) as raw:
                    cur = raw.cursor()
                    cur.execute("SELECT %(i)s::int * 2", {"i": i})
                    assert cur.fetchone()[0] == 2 * i
                    cur.close()
                with driver_statement(engine) as (raw, prefix):  # the claim round's one query
                    cur = raw.cursor()
                    cur.execute(prefix + "SELECT %(i)s::int * 3", {"i": i})
                    assert last_rows(cur) == [(3 * i,)]
                    cur.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=hammer, args=(e,)) for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        with WorkQueue([f"w{i}" for i in range(30)], url=url3, engine=engines[0], worker="b",
                       name="p3") as wq:
            assert sum(1 for _ in wq) == 30
    finally:
        for e in engines:
            e.dispose()


def test_no_lock_outlives_its_transaction(one_conn_bouncer: tuple[Any, str]) -> None:
    """The migration lock is transaction-scoped (``pg_advisory_xact_lock``): after workers joined
    and drained through the pooler, the server session holds no lock of any kind."""
    _, url = one_conn_bouncer
    for w in ("x", "y"):
        with WorkQueue([f"w{i}" for i in range(10)], url=url, worker=w, name="locks") as wq:
            list(wq)
    u = resolve_url(url)
    conn = psycopg2.connect(host=u.host, port=u.port, dbname=u.database, user=u.username)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT locktype, mode FROM pg_locks WHERE pid = pg_backend_pid() "
                        "AND NOT (locktype = 'relation' AND relation = 'pg_locks'::regclass) "
                        "AND locktype <> 'virtualxid'")
            assert cur.fetchall() == []
    finally:
        conn.close()


def test_startup_options_still_work_directly(pg_template: str) -> None:
    """``startup_options=True`` (direct connections only) sets the timeouts for the session and
    sends no per-transaction statement."""
    name = new_pg_database(pg_template)
    try:
        from backends import pg_url

        engine = make_engine(resolve_url(pg_url(name)), statement_timeout=9.0, startup_options=True)
        sent: list[str] = []
        sa.event.listen(engine, "before_cursor_execute", lambda *a: sent.append(a[2]))
        try:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
                assert c.exec_driver_sql("SHOW statement_timeout").scalar() == "9s"
            with engine.begin() as c:
                c.exec_driver_sql("SELECT 1")
            assert not any("set_config" in s for s in sent), sent
        finally:
            engine.dispose()
    finally:
        drop_pg_database(name)
