"""Schema creation and upgrades, run from code.

A brand-new database gets the schema on first use, exactly once even when many processes touch
it at the same instant (Postgres: a transaction-scoped advisory lock; SQLite: ``BEGIN
IMMEDIATE``; both backends run DDL transactionally). A database at another revision is never
changed silently: :class:`~wq_sql.errors.SchemaOutdated` names the command that upgrades it.
Once a DBA has migrated, workers only read ``alembic_version``, so they run without DDL rights.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Optional

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.exc import DBAPIError

from wq_sql.errors import SchemaOutdated
from wq_sql.store.dialects import dialect_of, qualifier
from wq_sql.store.driver import driver_read, last_rows
from wq_sql.store.redact import safe_url

_PG_INSUFFICIENT_PRIVILEGE = "42501"


def migrations_dir() -> Path:
    """The Alembic scripts: ``migrations/`` in the checkout this ``wq_sql`` was imported from,
    else ``wq_sql._migrations`` (a wheel). The checkout comes first: an editable install maps
    ``wq_sql._migrations`` to its own checkout, which may not be the one on ``PYTHONPATH``
    (a git worktree would then run another tree's migrations)."""
    here = Path(__file__).resolve().parent.parent / "migrations"
    if (here / "env.py").exists() and (here / "versions" / "0001_initial_schema.py").exists():
        return here
    spec = importlib.util.find_spec("wq_sql._migrations")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if (Path(loc) / "env.py").exists():
                return Path(loc)
    raise RuntimeError("wq_sql's migrations are missing from this installation; reinstall wq_sql")


def alembic_config(connection: Optional[Connection] = None, schema: Optional[str] = None,
                   url: Optional[str] = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["connection"] = connection
    cfg.attributes["schema"] = schema
    return cfg


@functools.lru_cache(maxsize=1)
def head_revision() -> str:
    """The newest shipped revision. Read once per process (and inherited by forked children):
    loading the scripts (Alembic imports every migration file) would otherwise be part of each
    queue object's opening, in every DataLoader worker; the shipped scripts do not change while
    the process runs."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def revisions() -> list[str]:
    """Every revision of the shipped migrations, oldest first."""
    script = ScriptDirectory.from_config(alembic_config())
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def current_revision(conn: Connection, schema: Optional[str] = None) -> Optional[str]:
    ctx = MigrationContext.configure(conn, opts={"version_table_schema": schema})
    return ctx.get_current_revision()


def _lock(conn: Connection) -> None:
    dialect_of(conn).lock_for_migration(conn)


def _upgrade_locked(conn: Connection, schema: Optional[str]) -> None:
    if schema:
        conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    command.upgrade(alembic_config(conn, schema), "head")


def upgrade(engine: Engine, schema: Optional[str] = None) -> str:
    """Create or upgrade the schema to the newest revision; returns that revision."""
    with engine.begin() as conn:
        _lock(conn)
        _upgrade_locked(conn, schema)
        rev = current_revision(conn, schema)
    assert rev is not None
    return rev


def _where(engine: Engine, schema: Optional[str]) -> str:
    return f"--url '{safe_url(engine.url)}'" + (f" --schema {schema}" if schema else "")


def _plain_revision(engine: Engine, schema: Optional[str]) -> Optional[str]:
    """The revision by one plain read (every queue object's opening, in every process: Alembic's
    ``MigrationContext`` sets up a migration environment to read one row), or None when that
    read fails or is not one row: then :func:`current_revision` decides."""
    table = f"{qualifier(schema)}alembic_version"
    try:
        # One driver-level statement, its own read transaction (SQLAlchemy's connection, BEGIN
        # and ROLLBACK around it would add round trips and Python to every forked DataLoader
        # worker's read).
        with driver_read(engine) as (conn, prefix):
            cur = conn.cursor()
            try:
                cur.execute(f"{prefix}SELECT version_num FROM {table}")
                rows = last_rows(cur)
            finally:
                cur.close()
    except DBAPIError:
        return None
    return str(rows[0][0]) if len(rows) == 1 else None


def ensure_schema(engine: Engine, schema: Optional[str] = None) -> None:
    """Create the schema of a brand-new database; refuse one at another revision."""
    head = head_revision()
    if _plain_revision(engine, schema) == head:
        return
    with engine.connect().execution_options(wq_read=True) as conn:
        rev = current_revision(conn, schema)
        conn.rollback()
    if rev == head:
        return
    if rev is None:
        with engine.begin() as conn:
            _lock(conn)
            rev = current_revision(conn, schema)
            if rev is None:
                existing = [t for t in inspect(conn).get_table_names(schema=schema) if t.startswith("wq_")]
                if existing:
                    raise SchemaOutdated(
                        f"{safe_url(engine.url)} has wq_sql tables ({', '.join(sorted(existing))}) but no "
                        "alembic_version row; it was not created by wq_sql's migrations. Stamp or drop it.")
                try:
                    _upgrade_locked(conn, schema)
                except DBAPIError as e:
                    if getattr(e.orig, "pgcode", None) != _PG_INSUFFICIENT_PRIVILEGE:
                        raise
                    raise SchemaOutdated(
                        f"{safe_url(engine.url)} has no wq_sql schema yet, and this database user may "
                        f"not create it ({str(e.orig).strip().splitlines()[0]}). Have its owner create "
                        f"it once with: python -m wq_sql upgrade {_where(engine, schema)}  (or "
                        "wq_sql.upgrade(url)); workers then need only SELECT, INSERT, UPDATE, DELETE "
                        "on its tables, USAGE on its sequences and EXECUTE on its function wq_claim_round "
                        "(Postgres grants that to every role unless revoked).") from e
                return
    if rev != head:
        where = _where(engine, schema)
        raise SchemaOutdated(
            f"the database is at schema revision {rev!r}, this wq_sql needs {head!r}. "
            f"Upgrade it with: python -m wq_sql upgrade {where}  (or wq_sql.upgrade(url)). "
            "If the database is newer, upgrade wq_sql instead.")
