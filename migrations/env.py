"""Alembic environment for wq_sql.

``wq_sql.migrate`` passes an open connection (inside the transaction that holds the migration
lock) and the Postgres schema through ``config.attributes``; the ``alembic`` command line in a
checkout uses ``sqlalchemy.url`` from alembic.ini, else ``$WQ_SQL_URL``.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, make_url

from wq_sql.store.models import Base, foreign_keys_of

config = context.config
schema = config.attributes.get("schema")


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or os.environ.get("WQ_SQL_URL") or "sqlite:///wq_sql.db"


def _configure(dialect: str, **kw: object) -> None:
    context.configure(target_metadata=Base.metadata, version_table_schema=schema,
                      compare_type=True, include_object=foreign_keys_of(dialect), **kw)


if context.is_offline_mode():
    _configure(make_url(_url()).get_backend_name(), url=_url(), literal_binds=True,
               dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()
else:
    connection = config.attributes.get("connection")
    if connection is None:
        with create_engine(_url()).connect() as connection:
            _configure(connection.dialect.name, connection=connection)
            with context.begin_transaction():
                context.run_migrations()
    else:
        _configure(connection.dialect.name, connection=connection)
        with context.begin_transaction():
            context.run_migrations()
