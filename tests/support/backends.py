"""The backends every test may run on, and fresh databases on them (the fixtures that use these
are in ``tests/conftest.py``).

Postgres: ``$WQ_SQL_TEST_PG`` (default ``postgresql://postgres@127.0.0.1:5432/postgres``) must be
reachable. ``pgbouncer``: the same server through a real PgBouncer in transaction mode
(``tests/support/pgbouncer.py``), for the contract suite (``tests/contract/``).
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

ROOT = Path(__file__).resolve().parents[2]
PG_ADMIN_URL = os.environ.get("WQ_SQL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
BACKENDS = ["sqlite", "postgresql"]
POOLED = "pgbouncer"  # Postgres through PgBouncer in transaction mode
BOUNCER_POOL_SIZE = 10  # server connections per database through the test PgBouncer


def admin_engine() -> sa.Engine:
    from wq_sql.store.engine import resolve_url

    return sa.create_engine(resolve_url(PG_ADMIN_URL), isolation_level="AUTOCOMMIT",
                            connect_args={"connect_timeout": 5})


def pg_url(db: str) -> str:
    from wq_sql.store.engine import resolve_url

    return resolve_url(PG_ADMIN_URL).set(database=db).render_as_string(hide_password=False)


def new_pg_database(template: str | None) -> str:
    name = f"wq_sql_t_{uuid.uuid4().hex[:12]}"
    engine = admin_engine()
    with engine.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")))
    engine.dispose()
    return name


def drop_pg_database(name: str) -> None:
    engine = admin_engine()
    with engine.connect() as c:
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()


def is_pg(backend: str) -> bool:
    """Whether ``backend`` is PostgreSQL, directly or through PgBouncer."""
    return backend != "sqlite"


def bouncer_url(bouncer: Any, db: str) -> str:
    """The URL of database ``db`` through ``bouncer``, with the admin URL's user and password."""
    from wq_sql.store.engine import resolve_url

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
        yield pg_url(name) if bouncer is None else bouncer_url(bouncer, name)
    finally:
        drop_pg_database(name)


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


def _parametrized_directly(metafunc: pytest.Metafunc, name: str) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        if name in ([n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)):
            return True
    return False


def parametrize_backends(metafunc: pytest.Metafunc, backends: list[str]) -> None:
    """Run a test that uses ``backend`` once on each of ``backends`` (unless it names its
    backends itself)."""
    if "backend" in metafunc.fixturenames and not _parametrized_directly(metafunc, "backend"):
        metafunc.parametrize("backend", backends, indirect=True)
