"""Migrations stay honest, and the schema is found, created and refused as documented.

Both backends: after ``upgrade head`` autogenerate finds no difference from the models; the
reflected schema equals what ``create_all`` plus the model's view SQL produce; downgrade then
upgrade works; an unknown revision is refused with the command that fixes it.
Postgres only: ``schema=``, and workers under a role without DDL rights.
SQLite only: network filesystems, in-memory URLs and missing folders are refused.
(Concurrent first-touch schema creation is covered by the multi-process tests.)
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from backends import table_rows
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

import wq_sql
from wq_sql import (
    DatabaseUnavailable,
    InvalidInput,
    QueueExhausted,
    SchemaOutdated,
    UnsafeDatabase,
    WorkQueue,
)
from wq_sql.monitor import report
from wq_sql.store import migrate
from wq_sql.store.dialects import sqlite as sqlite_dialect
from wq_sql.store.engine import resolve_url
from wq_sql.store.models import SQLITE_ONLY_FOREIGN_KEYS, VIEWS, Base, create_view_sql, foreign_keys_of

WORKS = ["a", "b", "c", "d"]
pg_only = pytest.mark.parametrize("backend", ["postgresql"])
sqlite_only = pytest.mark.parametrize("backend", ["sqlite"])


def engine_for(url: str, **kw: Any) -> sa.Engine:
    return sa.create_engine(resolve_url(url), poolclass=NullPool, **kw)


def query(url: str, sql: str, **params: Any) -> list[Any]:
    engine = engine_for(url)
    try:
        with engine.connect() as c:
            return list(c.execute(sa.text(sql), params))
    finally:
        engine.dispose()


def execute(url: str, *statements: str) -> None:
    engine = engine_for(url)
    try:
        with engine.begin() as c:
            for s in statements:
                c.execute(sa.text(s))
    finally:
        engine.dispose()


def drain(wq: WorkQueue) -> list[str]:
    return [str(i) for i in wq]


@pytest.fixture
def other_empty_db_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A second database without the wq_sql schema."""
    from backends import fresh_database

    yield from fresh_database(backend, tmp_path, request, "other", migrated=False)

# ---------------------------------------------------------------- reflection


def _norm_sql(text: Any) -> str:
    """A predicate, default or view body with casts, parentheses, quotes and spacing removed."""
    s = str(text).lower()
    s = re.sub(r"::[a-z ]+(\([0-9]+\))?", "", s)  # Postgres casts: ::text, ::character varying
    s = re.sub(r'[()"\s;]', "", s)
    return s


def snapshot(url: str) -> dict[str, Any]:
    """Everything about the wq_sql schema that reflection can see, in a comparable form."""
    engine = engine_for(url)
    try:
        with engine.connect() as c:
            insp = sa.inspect(c)
            dialect = c.dialect
            tables: dict[str, Any] = {}
            for t in sorted(insp.get_table_names()):
                if t == "alembic_version":
                    continue
                cols = [(col["name"], col["type"].compile(dialect=dialect), col["nullable"],
                         None if col.get("default") is None else _norm_sql(col["default"]))
                        for col in insp.get_columns(t)]
                pk = insp.get_pk_constraint(t)
                fks = sorted((fk["name"], tuple(fk["constrained_columns"]), fk["referred_table"],
                              tuple(fk["referred_columns"]),
                              (fk.get("options") or {}).get("ondelete", "").upper() or None)
                             for fk in insp.get_foreign_keys(t))
                indexes = sorted(
                    (ix["name"], tuple(ix["column_names"]), bool(ix["unique"]),
                     _norm_sql(_where(ix)) if _where(ix) is not None else None)
                    for ix in insp.get_indexes(t) if not ix.get("duplicates_constraint"))
                uniques = sorted((u["name"], tuple(u["column_names"]))
                                 for u in insp.get_unique_constraints(t))
                checks = sorted((ck["name"], _norm_sql(ck["sqltext"]))
                                for ck in insp.get_check_constraints(t))
                tables[t] = {"columns": cols, "pk": (pk["name"], tuple(pk["constrained_columns"])),
                             "fks": fks, "indexes": indexes, "uniques": uniques, "checks": checks}
            views = {v: {"columns": [(col["name"], col["type"].compile(dialect=dialect))
                                     for col in insp.get_columns(v)],
                         "definition": _norm_sql(re.sub(r"(?is)^\s*create\s+view\s+\S+\s+as", "",
                                                        insp.get_view_definition(v)))}
                     for v in sorted(insp.get_view_names())}
            return {"tables": tables, "views": views}
    finally:
        engine.dispose()


def _where(ix: dict[str, Any]) -> Any:
    opts = ix.get("dialect_options") or {}
    return opts.get("postgresql_where", opts.get("sqlite_where"))


def create_all(url: str) -> None:
    engine = engine_for(url)
    try:
        with engine.begin() as c:
            Base.metadata.create_all(c)
            for name in VIEWS:
                c.exec_driver_sql(create_view_sql(name))
    finally:
        engine.dispose()


def test_autogenerate_finds_no_difference_after_upgrade_head(empty_db_url: str) -> None:
    assert wq_sql.upgrade(empty_db_url) == migrate.head_revision()
    engine = engine_for(empty_db_url)
    try:
        with engine.connect() as c:
            ctx = MigrationContext.configure(c, opts={
                "compare_type": True, "compare_server_default": True,
                "target_metadata": Base.metadata, "include_object": foreign_keys_of(c.dialect.name)})
            diff = compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_reflected_schema_matches_create_all(empty_db_url: str, other_empty_db_url: str) -> None:
    wq_sql.upgrade(empty_db_url)
    create_all(other_empty_db_url)
    migrated, declared = snapshot(empty_db_url), snapshot(other_empty_db_url)

    # Sanity: the snapshot sees what matters, so equality below means something.
    tables = migrated["tables"]
    assert set(tables) == {"wq_queues", "wq_works", "wq_workers", "wq_items", "wq_tallies", "wq_events",
                           "wq_checkpoints", "wq_sources", "wq_mixes", "wq_quarantine", "wq_steps"}
    assert [c[0] for c in tables["wq_checkpoints"]["checks"]] == ["ck_wq_checkpoints_action"]
    ix = {i[0]: i for i in tables["wq_items"]["indexes"]}
    assert ix["ix_wq_items_pending"][1:] == (("queue_id", "epoch", "seq"), False, "state='pending'")
    assert ix["ix_wq_items_claimed"][1:] == (("queue_id", "worker_id", "lease_until"), False,
                                             "state='claimed'")
    assert ("uq_wq_items_queue_id", ("queue_id", "epoch", "seq")) in tables["wq_items"]["uniques"]
    assert ("uq_wq_queues_name", ("name",)) in tables["wq_queues"]["uniques"]
    # The hot path's foreign keys: SQLite only (migration 0009); the others on both backends.
    fks = _fks(empty_db_url)
    assert "fk_wq_items_queue_id_wq_queues" in fks and "fk_wq_tallies_queue_id_wq_queues" in fks
    sqlite = empty_db_url.startswith("sqlite")
    assert {n: n in fks for n in SQLITE_ONLY_FOREIGN_KEYS} == dict.fromkeys(SQLITE_ONLY_FOREIGN_KEYS, sqlite)
    assert [c[0] for c in migrated["views"]["wq_audit"]["columns"]] == [
        "queue", "epoch", "seq", "work", "worker", "state", "attempts", "claimed_at", "done_at",
        "last_error", "item_id", "source"]
    assert [c[0] for c in migrated["views"]["wq_history"]["columns"]] == [
        "queue", "epoch", "seq", "kind", "worker", "at", "detail", "item_id", "event_id", "source"]
    assert [c[0] for c in migrated["views"]["wq_lineage"]["columns"]] == [
        "queue", "run", "worker", "step", "part", "epoch", "seq", "work", "first_record", "last_record",
        "checkpoint", "item_id"]

    for name in tables:
        for part in ("columns", "pk", "fks", "indexes", "uniques", "checks"):
            assert migrated["tables"][name][part] == declared["tables"][name][part], (name, part)
    assert migrated == declared


@pg_only
def test_postgres_autovacuum_tuning_is_applied(empty_db_url: str) -> None:
    """The one deliberate difference from create_all: the migration tunes autovacuum of the hot
    item table (dead entries in the pending index), a storage option the models do not declare."""
    wq_sql.upgrade(empty_db_url)
    opts = query(empty_db_url, "SELECT reloptions FROM pg_class WHERE relname = 'wq_items'")[0][0]
    assert "autovacuum_vacuum_scale_factor=0.01" in opts


def _fks(url: str) -> set[str]:
    return {fk[0] for t in snapshot(url)["tables"].values() for fk in t["fks"]}


def _rows(url: str) -> dict[str, list[tuple[Any, ...]]]:
    engine = engine_for(url)
    try:
        return table_rows(engine)
    finally:
        engine.dispose()


KEYS_0009 = SQLITE_ONLY_FOREIGN_KEYS[:2]  # the two that revision 0009 dropped


def test_0009_drops_the_hot_path_foreign_keys_on_postgres_only_and_keeps_every_row(empty_db_url: str) -> None:
    """A queue mid-drain (items done, one claimed by a worker still open, history rows), taken
    down to 0008 (which adds the two keys back on Postgres: every row written without them must
    satisfy them) and up again: every row as it was, the two keys gone on Postgres only, and the
    open worker drains the rest, each item done once."""
    sqlite = empty_db_url.startswith("sqlite")
    wq_sql.upgrade(empty_db_url)
    works = [f"w{i:02d}" for i in range(12)]
    with WorkQueue(works, name="q", url=empty_db_url, worker="b", shuffle=False) as b:
        b.take()
        b.take()
    a = WorkQueue.attach("q", url=empty_db_url, worker="a", lease_ahead=1)
    try:
        for _ in range(4):
            a.take()  # the last one claimed and in hand
        engine = engine_for(empty_db_url)
        try:
            with engine.begin() as c:
                command.downgrade(migrate.alembic_config(c), "0008")
            assert set(KEYS_0009) <= _fks(empty_db_url)
            before = _rows(empty_db_url)
            assert {r[5] for r in before["wq_items"]} == {"done", "claimed", "pending"}  # state
            with engine.begin() as c:
                command.upgrade(migrate.alembic_config(c), "0009")
        finally:
            engine.dispose()
        assert _rows(empty_db_url) == before
        have = _fks(empty_db_url)
        want = dict.fromkeys(KEYS_0009, sqlite)
        assert {n: n in have for n in KEYS_0009} == want
        assert "fk_wq_items_queue_id_wq_queues" in have
        engine = engine_for(empty_db_url)
        try:
            with engine.begin() as c:
                command.upgrade(migrate.alembic_config(c), "head")  # the open worker runs today's code
        finally:
            engine.dispose()
        taken = 0
        with pytest.raises(QueueExhausted):
            while True:
                a.take()
                taken += 1
        assert taken == len(works) - 6
    finally:
        a.close()
    engine = engine_for(empty_db_url)
    try:
        with engine.connect() as c:
            audit = report.audit(c, c.execute(sa.text("SELECT * FROM wq_queues WHERE name = 'q'")).one())
            done = c.execute(sa.text(
                "SELECT count(*) FROM wq_history WHERE queue = 'q' AND kind = 'done'")).scalar()
    finally:
        engine.dispose()
    assert audit.ok, (audit.violations, audit.counter_mismatches)
    assert done == len(works)  # (redeliveries: b gave back what it had claimed ahead)


def test_downgrade_to_base_then_upgrade_head(empty_db_url: str) -> None:
    head = wq_sql.upgrade(empty_db_url)
    with WorkQueue(WORKS, name="q", url=empty_db_url, worker="w") as wq:
        wq.take()
    engine = engine_for(empty_db_url)
    try:
        with engine.begin() as c:
            command.downgrade(migrate.alembic_config(c), "base")
        with engine.connect() as c:
            insp = sa.inspect(c)
            assert [t for t in insp.get_table_names() if t != "alembic_version"] == []
            assert insp.get_view_names() == []
            assert migrate.current_revision(c) is None
    finally:
        engine.dispose()
    assert wq_sql.upgrade(empty_db_url) == head
    assert wq_sql.upgrade(empty_db_url) == head  # idempotent
    with WorkQueue(WORKS, shuffle=False, name="q", url=empty_db_url, worker="w") as wq:
        assert drain(wq) == WORKS


def test_first_use_creates_the_schema(empty_db_url: str) -> None:
    with WorkQueue(WORKS, shuffle=False, name="q", url=empty_db_url, worker="w") as wq:
        assert drain(wq) == WORKS
    assert query(empty_db_url, "SELECT version_num FROM alembic_version")[0][0] == migrate.head_revision()


@pytest.mark.parametrize("stamp", ["0000_older", "ffffffffffff"])
def test_unknown_or_older_revision_is_refused_with_the_upgrade_command(
        empty_db_url: str, stamp: str) -> None:
    wq_sql.upgrade(empty_db_url)
    execute(empty_db_url, f"UPDATE alembic_version SET version_num = '{stamp}'")
    with pytest.raises(SchemaOutdated) as ei:
        WorkQueue(WORKS, url=empty_db_url, worker="w")
    msg = str(ei.value)
    assert "python -m wq_sql upgrade" in msg and repr(stamp) in msg
    assert repr(migrate.head_revision()) in msg
    # Admin functions refuse too, and nothing was changed.
    with pytest.raises(SchemaOutdated):
        wq_sql.list_queues(empty_db_url)
    assert query(empty_db_url, "SELECT version_num FROM alembic_version")[0][0] == stamp


def test_tables_without_a_revision_are_refused(empty_db_url: str) -> None:
    wq_sql.upgrade(empty_db_url)
    execute(empty_db_url, "DELETE FROM alembic_version")
    with pytest.raises(SchemaOutdated, match="no alembic_version row"):
        WorkQueue(WORKS, url=empty_db_url, worker="w")


@pg_only
def test_schema_outdated_message_hides_the_password(empty_db_url: str) -> None:
    wq_sql.upgrade(empty_db_url)
    execute(empty_db_url, "UPDATE alembic_version SET version_num = 'old'")
    # The test server trusts local connections, so any password is accepted.
    with_password = make_url(empty_db_url).set(password="s3cr3t-pw").render_as_string(hide_password=False)
    with pytest.raises(SchemaOutdated) as ei:
        WorkQueue(WORKS, url=with_password, worker="w")
    assert "s3cr3t-pw" not in str(ei.value) and "***" in str(ei.value)


# ---------------------------------------------------------------- Postgres: schema=


@pg_only
def test_queues_in_a_named_schema(db_url: str) -> None:
    """db_url's public schema is migrated too: the named schemas must not touch it."""
    with WorkQueue(WORKS, shuffle=False, name="q", url=db_url, worker="w", schema="team_a") as a:
        assert a.take() == "a"
        # Same queue name, another schema, other works: an independent queue, no mismatch.
        with WorkQueue(["x", "y"], num_epochs=2, shuffle=False, name="q", url=db_url, worker="w",
                       schema="team_b") as b:
            assert drain(b) == ["x", "y", "x", "y"]
        assert drain(a) == WORKS[1:]
    assert query(db_url, "SELECT count(*) FROM wq_queues")[0][0] == 0  # public untouched
    for schema, works in (("team_a", WORKS), ("team_b", ["x", "y"] * 2)):
        tables = {r[0] for r in query(db_url, "SELECT table_name FROM information_schema.tables "
                                              "WHERE table_schema = :s", s=schema)}
        assert {"alembic_version", "wq_items", "wq_queues", "wq_audit", "wq_history"} <= tables
        rows = query(db_url, f"SELECT queue, work, state FROM {schema}.wq_audit ORDER BY epoch, seq")
        assert [(r.queue, r.work, r.state) for r in rows] == [("q", w, "done") for w in works]
        assert query(db_url, f"SELECT version_num FROM {schema}.alembic_version")[0][0] == \
            migrate.head_revision()
    # The view of one schema reads that schema's tables only.
    defn = query(db_url, "SELECT pg_get_viewdef('team_b.wq_audit'::regclass)")[0][0]
    assert "team_b.wq_items" in defn and "team_a" not in defn and "public" not in defn
    # Admin functions take the schema too.
    assert [(q["name"], q["done"]) for q in wq_sql.list_queues(db_url, schema="team_b")] == [("q", 4)]
    wq_sql.reset_queue("q", url=db_url, schema="team_b")
    assert query(db_url, "SELECT count(*) FROM team_a.wq_audit WHERE state = 'done'")[0][0] == 4
    assert wq_sql.drop_queue("q", url=db_url, schema="team_a") is True
    assert query(db_url, "SELECT count(*) FROM team_b.wq_queues")[0][0] == 1
    assert wq_sql.upgrade(db_url, schema="team_a") == migrate.head_revision()


@pg_only
def test_schema_must_be_a_plain_identifier(db_url: str) -> None:
    with pytest.raises(InvalidInput, match="schema"):
        WorkQueue(WORKS, url=db_url, worker="w", schema='x"; DROP SCHEMA public; --')


@sqlite_only
def test_schema_is_refused_on_sqlite(db_url: str) -> None:
    with pytest.raises(InvalidInput, match="PostgreSQL"):
        WorkQueue(WORKS, url=db_url, worker="w", schema="team_a")


# ---------------------------------------------------------------- Postgres: roles without DDL


@pytest.fixture
def make_role() -> Iterator[Callable[..., str]]:
    """``make_role(db_url, dml=True)``: a login role on that database, with only SELECT, INSERT,
    UPDATE, DELETE on the tables and USAGE on the sequences of ``public`` when ``dml``; returns
    a URL that connects as it. Dropped (with its grants) after the test."""
    from backends import PG_ADMIN_URL

    made: list[tuple[str, str]] = []

    def make(db_url: str, dml: bool = True) -> str:
        role = f"wq_worker_{uuid.uuid4().hex[:10]}"
        db = make_url(db_url).database
        made.append((role, db_url))
        statements = [f'CREATE ROLE "{role}" LOGIN', f'GRANT CONNECT ON DATABASE "{db}" TO "{role}"',
                      f'GRANT USAGE ON SCHEMA public TO "{role}"']
        if dml:
            statements += [
                f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO "{role}"',
                f'GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO "{role}"']
        execute(db_url, *statements)
        return make_url(db_url).set(username=role).render_as_string(hide_password=False)

    yield make
    for role, db_url in made:
        admin = engine_for(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE usename = :r"), {"r": role})
        admin.dispose()
        try:
            execute(db_url, f'DROP OWNED BY "{role}"')
        except sa.exc.OperationalError:
            pass  # the database is gone already, and its grants with it
        admin = engine_for(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(sa.text(f'DROP ROLE IF EXISTS "{role}"'))
        admin.dispose()


@pg_only
def test_worker_without_ddl_rights_creates_and_drains_a_queue(
        db_url: str, make_role: Callable[..., str]) -> None:
    wq_sql.upgrade(db_url)  # the DBA's step (the template is migrated already: a no-op)
    role_url = make_role(db_url)
    role = make_url(role_url).username
    # The role really cannot change the schema.
    with pytest.raises(sa.exc.ProgrammingError, match="permission denied"):
        execute(role_url, "CREATE TABLE wq_intruder (x int)")
    with pytest.raises(sa.exc.ProgrammingError):
        execute(role_url, "ALTER TABLE wq_items ADD COLUMN x int")

    with WorkQueue(WORKS, num_epochs=2, shuffle=False, name="q", url=role_url, worker="w1") as a, \
         WorkQueue(WORKS, num_epochs=2, shuffle=False, name="q", url=role_url, worker="w2") as b:
        got = [a.take(), b.take()]
        b.fail(got[1], "retry me")
        got += drain(a)
        with pytest.raises(QueueExhausted):
            b.take()
    assert sorted(got[:1] + got[2:]) == sorted(WORKS * 2)
    rows = query(role_url, "SELECT state, count(*) FROM wq_audit GROUP BY state")
    assert dict((r[0], r[1]) for r in rows) == {"done": 8}
    assert [q["done"] for q in wq_sql.list_queues(role_url)] == [8]
    wq_sql.reset_queue("q", url=role_url)
    assert wq_sql.drop_queue("q", url=role_url) is True
    # Everything ran as the role, not as the superuser.
    assert query(role_url, "SELECT current_user")[0][0] == role


@pg_only
def test_role_without_ddl_rights_on_an_unmigrated_database_gets_a_clear_error(
        empty_db_url: str, make_role: Callable[..., str]) -> None:
    role_url = make_role(empty_db_url, dml=False)
    with pytest.raises(SchemaOutdated) as ei:
        WorkQueue(WORKS, url=role_url, worker="w")
    msg = str(ei.value)
    assert "permission denied" in msg and "python -m wq_sql upgrade" in msg
    assert query(empty_db_url, "SELECT count(*) FROM information_schema.tables "
                               "WHERE table_schema = 'public'")[0][0] == 0
    # The same role cannot make a schema of its own either, with the same clear error.
    with pytest.raises(SchemaOutdated, match="--schema team_x"):
        WorkQueue(WORKS, url=role_url, worker="w", schema="team_x")
    # Once the owner migrated and granted, the same role works.
    wq_sql.upgrade(empty_db_url)
    role = make_url(role_url).username
    execute(empty_db_url,
            f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO "{role}"',
            f'GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO "{role}"')
    with WorkQueue(WORKS, shuffle=False, url=role_url, worker="w") as wq:
        assert drain(wq) == WORKS


# ---------------------------------------------------------------- SQLite: where the file may live


@pytest.fixture
def fake_mounts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[str], None]:
    """Point ``wq_sql.dialects.sqlite.mount_fstype`` at a fake ``/proc/mounts`` (the one mock here)."""
    mounts = tmp_path / "fake_mounts"
    monkeypatch.setattr(sqlite_dialect, "MOUNTS", str(mounts))
    monkeypatch.delenv("WQ_SQL_ALLOW_NETWORK_FS", raising=False)

    def write(text: str) -> None:
        mounts.write_text(text)

    return write


ROOT_LINE = "/dev/sda1 / ext4 rw,relatime 0 0\n"


@pytest.mark.parametrize("fstype", ["nfs", "nfs4", "lustre", "gpfs", "cifs", "fuse.sshfs"])
def test_sqlite_on_a_network_filesystem_is_refused(fake_mounts: Callable[[str], None], tmp_path: Path,
                                                   fstype: str) -> None:
    shared = (tmp_path / "shared").resolve()
    shared.mkdir()
    fake_mounts(ROOT_LINE + f"server:/export {shared} {fstype} rw,vers=4.2 0 0\n")
    db = shared / "sub" / "q.db"
    db.parent.mkdir()
    assert sqlite_dialect.mount_fstype(db.parent) == fstype
    with pytest.raises(UnsafeDatabase) as ei:
        sqlite_dialect.check_path(make_url(f"sqlite:///{db}"))
    assert fstype in str(ei.value) and "PostgreSQL" in str(ei.value)
    with pytest.raises(UnsafeDatabase):
        WorkQueue(WORKS, url=f"sqlite:///{db}", worker="w")
    assert not db.exists()


def test_mount_lookup_takes_the_longest_matching_mount_point(fake_mounts: Callable[[str], None],
                                                            tmp_path: Path) -> None:
    base = tmp_path.resolve()
    (base / "nfs" / "local").mkdir(parents=True)
    (base / "nfs2").mkdir()
    (base / "with space").mkdir()
    fake_mounts(ROOT_LINE
                + f"server:/export {base}/nfs nfs4 rw 0 0\n"
                + f"/dev/sdb1 {base}/nfs/local xfs rw 0 0\n"
                + f"server:/x {base}/with\\040space lustre rw 0 0\n"
                + "garbage\n")
    assert sqlite_dialect.mount_fstype(base / "nfs") == "nfs4"
    assert sqlite_dialect.mount_fstype(base / "nfs" / "local") == "xfs"
    # /x/nfs2 is not inside the mount point /x/nfs.
    assert sqlite_dialect.mount_fstype(base / "nfs2") == "ext4"
    assert sqlite_dialect.mount_fstype(base / "with space") == "lustre"
    sqlite_dialect.check_path(make_url(f"sqlite:///{base}/nfs/local/q.db"))
    sqlite_dialect.check_path(make_url(f"sqlite:///{base}/nfs2/q.db"))
    with pytest.raises(UnsafeDatabase, match="lustre"):
        sqlite_dialect.check_path(make_url(f"sqlite:///{base}/with space/q.db"))
    # A local file through a relative URL is resolved before the lookup.
    with WorkQueue(WORKS, shuffle=False, url=f"sqlite:///{base}/nfs/local/q.db", worker="w") as wq:
        assert drain(wq) == WORKS


def test_network_filesystem_override(fake_mounts: Callable[[str], None], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fake_mounts(ROOT_LINE + f"server:/export {tmp_path.resolve()} nfs rw 0 0\n")
    url = make_url(f"sqlite:///{tmp_path / 'q.db'}")
    with pytest.raises(UnsafeDatabase):
        sqlite_dialect.check_path(url)
    monkeypatch.setenv("WQ_SQL_ALLOW_NETWORK_FS", "1")
    sqlite_dialect.check_path(url)


def test_unreadable_mounts_file_does_not_block(fake_mounts: Callable[[str], None], tmp_path: Path) -> None:
    # No fake file written: reading it fails, the filesystem is unknown, the path is allowed.
    assert sqlite_dialect.mount_fstype(tmp_path) is None
    sqlite_dialect.check_path(make_url(f"sqlite:///{tmp_path / 'q.db'}"))


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:///file:q?mode=memory&uri=true"])
def test_in_memory_sqlite_is_refused(url: str) -> None:
    with pytest.raises(InvalidInput, match="in-memory") as ei:
        WorkQueue(WORKS, url=url, worker="w")
    assert "sqlite:///path" in str(ei.value)


def test_missing_sqlite_folder_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "folder"
    with pytest.raises(DatabaseUnavailable, match="does not exist; create it first") as ei:
        WorkQueue(WORKS, url=f"sqlite:///{missing}/q.db", worker="w")
    assert str(missing) in str(ei.value)
    assert not missing.exists()


def test_unsupported_or_malformed_url_is_a_clear_error() -> None:
    with pytest.raises(InvalidInput, match="unsupported database"):
        WorkQueue(WORKS, url="mysql://u@h/db", worker="w")
    with pytest.raises(InvalidInput, match="not a database URL") as ei:
        WorkQueue(WORKS, url="::not a url:: password=hunter2", worker="w")
    assert "hunter2" not in str(ei.value)
