"""Fixtures shared by every test: one suite, run on every backend.

``db_url`` is a fresh database per test: a new SQLite file, or a new Postgres database copied
from a template that was migrated once per session (``CREATE DATABASE ... TEMPLATE``). Under CI
(``$CI`` set) an unreachable Postgres or a missing PgBouncer fails the run; elsewhere those
tests are skipped with the reason.

Every test that takes ``backend`` runs on SQLite and Postgres; the tests of ``tests/contract/``
also through PgBouncer (its own ``conftest.py`` says so). The helpers behind the fixtures are
``tests/support/backends.py`` (``tests/support`` is on ``sys.path``: pyproject's ``pythonpath``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from backends import (
    BACKENDS,
    BOUNCER_POOL_SIZE,
    PG_ADMIN_URL,
    admin_engine,
    fresh_database,
    parametrize_backends,
    pg_url,
)

_TEMPLATE = f"wq_sql_tmpl_{os.getpid()}"
CONTRACT = Path(__file__).resolve().parent / "contract"  # its conftest picks its backends


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """A database migrated to head once; each test copies it."""
    try:
        engine = admin_engine()
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

    wq_sql.upgrade(pg_url(_TEMPLATE))
    yield _TEMPLATE
    with engine.connect() as c:
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{_TEMPLATE}" WITH (FORCE)'))
    engine.dispose()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """SQLite and Postgres; a folder's own ``conftest.py`` may say otherwise (``tests/contract/``)."""
    if CONTRACT not in metafunc.definition.path.parents:
        parametrize_backends(metafunc, BACKENDS)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def pgbouncer(pg_template: str) -> Iterator[Any]:
    """A PgBouncer in transaction mode in front of the test server, for the whole session."""
    from pgbouncer import PgBouncer, PgBouncerError

    admin = admin_engine().url
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


@pytest.fixture
def db_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, migrated database for this test."""
    yield from fresh_database(backend, tmp_path, request, "wq", migrated=True)


@pytest.fixture
def empty_db_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh database without the wq_sql schema (for schema-creation tests)."""
    yield from fresh_database(backend, tmp_path, request, "empty", migrated=False)


@pytest.fixture
def sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every size the automatic ``lease_ahead`` takes (it may grow and shrink between two
    lines; the bound holds against the size in force at each claim)."""
    seen: list[int] = []

    def get(self: Any) -> int:
        return self.__dict__["size"]

    def put(self: Any, n: int) -> None:
        self.__dict__["size"] = n
        seen.append(n)

    from wq_sql.worker.sizing import Sizer

    monkeypatch.setattr(Sizer, "size", property(get, put), raising=False)
    return seen
