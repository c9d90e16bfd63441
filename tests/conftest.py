"""Fixtures shared by every test: one suite, run on both backends.

``db_url`` is a fresh database per test: a new SQLite file, or a new Postgres database copied
from a template that was migrated once per session (``CREATE DATABASE ... TEMPLATE``).

Postgres: ``$WQ_SQL_TEST_PG`` (default ``postgresql://postgres@127.0.0.1:5432/postgres``) must be
reachable. Under CI (``$CI`` set) an unreachable server fails the run; elsewhere the Postgres
half of the suite is skipped with the reason.

The contract suite (:data:`CONTRACT_MODULES`: claims, leases, fencing, crashes, epochs, waits,
sliced reads) runs on a third backend, ``pgbouncer``: the same Postgres server through a real
PgBouncer in transaction mode (``tests/pgbouncer.py``, a small server pool), started once per
session. Its databases are made and dropped through the admin connection, directly; the test
gets a plain URL of PgBouncer. PgBouncer comes from ``$WQ_SQL_PGBOUNCER`` or ``$PATH``
(``scripts/pgbouncer.sh`` installs it); under CI a missing one fails, elsewhere it skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN_URL = os.environ.get("WQ_SQL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
BACKENDS = ["sqlite", "postgresql"]
POOLED = "pgbouncer"  # Postgres through PgBouncer in transaction mode
# The modules that form the contract every backend must pass, also through PgBouncer.
CONTRACT_MODULES = {"test_smoke", "test_semantics", "test_concurrency", "test_crash", "test_epochs",
                    "test_waits", "test_sources", "test_chaos", "test_bell", "test_renewal"}
BOUNCER_POOL_SIZE = 10  # server connections per database through the test PgBouncer
_TEMPLATE = f"wq_sql_tmpl_{os.getpid()}"


def _admin_engine() -> sa.Engine:
    from wq_sql.engine import resolve_url

    return sa.create_engine(resolve_url(PG_ADMIN_URL), isolation_level="AUTOCOMMIT",
                            connect_args={"connect_timeout": 5})


def _pg_url(db: str) -> str:
    from wq_sql.engine import resolve_url

    return resolve_url(PG_ADMIN_URL).set(database=db).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """A database migrated to head once; each test copies it."""
    try:
        engine = _admin_engine()
        with engine.connect() as c:
            c.execute(sa.text("SELECT 1"))
    except Exception as e:
        msg = f"PostgreSQL at {PG_ADMIN_URL} is unreachable ({type(e).__name__}: {str(e).strip()[:200]})"
        if os.environ.get("CI"):
            pytest.fail(msg + "; Postgres tests are required in CI", pytrace=False)
        pytest.skip(msg + "; start it or set WQ_SQL_TEST_PG")
    with engine.connect() as c:
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{_TEMPLATE}" WITH (FORCE)'))
        c.execute(sa.text(f'CREATE DATABASE "{_TEMPLATE}"'))
    import wq_sql

    wq_sql.upgrade(_pg_url(_TEMPLATE))
    yield _TEMPLATE
    with engine.connect() as c:
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{_TEMPLATE}" WITH (FORCE)'))
    engine.dispose()


def new_pg_database(template: str | None) -> str:
    name = f"wq_sql_t_{uuid.uuid4().hex[:12]}"
    engine = _admin_engine()
    with engine.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")))
    engine.dispose()
    return name


def drop_pg_database(name: str) -> None:
    engine = _admin_engine()
    with engine.connect() as c:
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()


def _parametrized_directly(metafunc: pytest.Metafunc, name: str) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        if name in ([n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)):
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that uses ``backend`` runs on each of :data:`BACKENDS`, and, in the contract
    modules, through PgBouncer too (unless it names its backends itself)."""
    if "backend" not in metafunc.fixturenames or _parametrized_directly(metafunc, "backend"):
        return
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    metafunc.parametrize("backend", BACKENDS + ([POOLED] if module in CONTRACT_MODULES else []),
                         indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def is_pg(backend: str) -> bool:
    """Whether ``backend`` is PostgreSQL, directly or through PgBouncer."""
    return backend != "sqlite"


@pytest.fixture(scope="session")
def pgbouncer(pg_template: str) -> Iterator[Any]:
    """A PgBouncer in transaction mode in front of the test server, for the whole session."""
    sys.path.insert(0, str(ROOT / "tests"))
    from pgbouncer import PgBouncer, PgBouncerError

    admin = _admin_engine().url
    try:
        bouncer = PgBouncer(admin.host or "127.0.0.1", admin.port or 5432, pool_size=BOUNCER_POOL_SIZE,
                            user=admin.username or "postgres").start()
    except PgBouncerError as e:
        if os.environ.get("CI"):
            pytest.fail(f"{e}; the PgBouncer tests are required in CI", pytrace=False)
        pytest.skip(str(e))
    try:
        yield bouncer
    finally:
        bouncer.close()


def bouncer_url(bouncer: Any, db: str) -> str:
    """The URL of database ``db`` through ``bouncer``, with the admin URL's user and password."""
    from wq_sql.engine import resolve_url

    return (resolve_url(PG_ADMIN_URL).set(host="127.0.0.1", port=bouncer.port, database=db)
            .render_as_string(hide_password=False))


def fresh_database(backend: str, tmp_path: Path, request: pytest.FixtureRequest, stem: str,
                   migrated: bool) -> Iterator[str]:
    """Yield the URL of a new database for one test: a SQLite file ``<stem>.db`` (wq_sql
    migrates it on first use), or a Postgres database copied from the migrated template
    (``migrated``) or empty, dropped afterwards. Skips or fails as ``pg_template`` does."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / (stem + '.db')}"
        return
    template = request.getfixturevalue("pg_template")
    bouncer = request.getfixturevalue("pgbouncer") if backend == POOLED else None
    name = new_pg_database(template if migrated else None)
    try:
        yield _pg_url(name) if bouncer is None else bouncer_url(bouncer, name)
    finally:
        drop_pg_database(name)


@pytest.fixture
def db_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, migrated database for this test."""
    yield from fresh_database(backend, tmp_path, request, "wq", migrated=True)


@pytest.fixture
def empty_db_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh database without the wq_sql schema (for schema-creation tests)."""
    yield from fresh_database(backend, tmp_path, request, "empty", migrated=False)


def run_py(code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code args`` with this checkout importable; raises if it fails."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       timeout=timeout, env=full_env, cwd=cwd)
    if p.returncode != 0:
        raise AssertionError(f"subprocess failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


JOB_TABLES = ("wq_queues", "wq_works", "wq_workers", "wq_items", "wq_tallies", "wq_events")


def table_rows(engine: sa.Engine, tables: tuple[str, ...] = JOB_TABLES) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of each table, sorted: to check that something left a database as it was."""
    with engine.connect() as c:
        return {t: sorted(tuple(r) for r in c.execute(sa.text(f"SELECT * FROM {t}"))) for t in tables}
