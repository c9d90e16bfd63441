"""Helpers for the tests that run the examples on both backends (a plain module, importable from
``tests/`` and ``tests/tf/`` alike because pytest puts ``tests/`` on ``sys.path`` for conftest.py)."""

from __future__ import annotations

import sqlalchemy as sa

import wq_sql


def user_url(db_url: str) -> str:
    """The test database's URL as users write it: ``postgresql://`` without a driver, which
    SQLAlchemy 2.1 maps to psycopg 3 in a user's own ``create_engine`` (wq_sql maps it to psycopg2)."""
    url = sa.make_url(db_url)
    if url.get_backend_name() == "postgresql":
        url = url.set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


def tables_in(url: str) -> list[str]:
    engine = sa.create_engine(url)
    try:
        return sorted(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def queues_created_in(pg_url: str) -> int:
    """How many queue rows were ever inserted into this Postgres database (its id sequence is
    not rolled back by a drop): proof that an example really ran there."""
    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as c:
            last = c.execute(sa.text(
                "SELECT pg_sequence_last_value(pg_get_serial_sequence('wq_queues', 'id'))")).scalar()
    finally:
        engine.dispose()
    return int(last or 0)


def assert_left_nothing(pg_url: str, tables_before: list[str]) -> None:
    """An example that ran on this Postgres database left no queue and no table behind."""
    assert queues_created_in(pg_url) > 0, "the example did not run on the database it was given"
    assert wq_sql.list_queues(pg_url) == [], "the example left its queue behind"
    assert tables_in(pg_url) == tables_before, "the example left a table behind"
