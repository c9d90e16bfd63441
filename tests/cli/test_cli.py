"""Acceptance tests: the real ``python -m wq_sql`` command as a subprocess, on both backends."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from wq_sql.store.engine import resolve_url

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret-Pw"


def wq(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WQ_SQL_")}
    full_env.update({"PYTHONPATH": str(ROOT), **(env or {})})
    return subprocess.run([sys.executable, "-m", "wq_sql", *args], capture_output=True, text=True,
                          timeout=120, env=full_env, cwd=cwd)


def ok(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 0, f"exit {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def one_line_error(p: subprocess.CompletedProcess[str], *needles: str) -> str:
    """A failed command: non-zero exit, nothing on stdout, one line on stderr, no traceback."""
    assert p.returncode != 0, p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and p.stdout == "", f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    line = lines[0]
    assert line.startswith("wq-sql: error: ") and "Traceback" not in line
    for needle in needles:
        assert needle in line, line
    return line


def table(out: str, header: str) -> dict[str, list[str]]:
    """The rows of the table printed under a header line starting with ``header``, by first cell."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        cells = line.split()
        if len(cells) > 1 and cells[1] == "(not":  # "1 (not created yet)"
            cells = [cells[0]] + cells[4:]
        rows[cells[0]] = cells[1:]
    return rows


HOLDER = """
import sys
from wq_sql import WorkQueue
wq = WorkQueue([f"w{i}" for i in range(10)], num_epochs=2, shuffle=False, name="train",
               url=sys.argv[1], worker="alice", lease_ahead=1, claim_ahead=False)  # no item ahead
for _ in range(4):
    wq.take()  # three done (each acked by the next take), the fourth claimed
print("holding", flush=True)
sys.stdin.readline()
wq.close()
"""


def test_upgrade_ls_status_reset_drop(db_url: str, tmp_path: Path) -> None:
    out = ok(wq("upgrade", "--url", db_url, cwd=tmp_path))
    assert "revision" in out and "(head)" in out
    assert "(head)" in ok(wq("current", "--url", db_url, cwd=tmp_path))
    assert "no queues" in ok(wq("ls", "--url", db_url, cwd=tmp_path))

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, db_url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        ls = table(ok(wq("--url", db_url, "ls", cwd=tmp_path)), "QUEUE")  # options before the command
        # ITEMS/EPOCH EPOCHS SHUFFLE SEED SLICES PREFIX DONE FAILED TOTAL PROGRESS
        assert ls["train"][0:3] == ["10", "2/2", "no"] and ls["train"][-4:] == ["3", "0", "20", "15.0%"]

        out = ok(wq("status", "train", "--url", db_url, cwd=tmp_path))
        assert "queue 'train'" in out and "10 items per epoch, 2 epoch(s), in order" in out
        epochs = table(out, "EPOCH")
        assert epochs["0"] == ["6", "1", "3", "0"]   # pending claimed done failed
        assert epochs["1"] == ["10", "0", "0", "0"]
        assert epochs["total"] == ["16", "1", "3", "0"]
        workers = table(out, "WORKER")
        assert list(workers) == ["alice"]
        assert workers["alice"][-4:] == ["1", "3", "0", "3"]  # holding done failed done/min
        assert "ago" in " ".join(workers["alice"])
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        assert holder.wait(timeout=60) == 0

    out = ok(wq("status", "train", "--url", db_url, cwd=tmp_path))
    assert table(out, "EPOCH")["total"] == ["16", "0", "4", "0"]
    assert "no live workers" in out and "1 worker(s) closed cleanly" in out

    one_line_error(wq("reset", "train", "--url", db_url, cwd=tmp_path), "--yes")
    assert "reset queue 'train'" in ok(wq("reset", "train", "--yes", "--url", db_url, cwd=tmp_path))
    epochs = table(ok(wq("status", "train", "--url", db_url, cwd=tmp_path)), "EPOCH")
    assert epochs["0"] == ["10", "0", "0", "0"] and epochs["1"] == ["10", "0", "0", "0"]  # 1: not created

    one_line_error(wq("drop", "train", "--url", db_url, cwd=tmp_path), "--yes")
    assert "dropped queue 'train'" in ok(wq("drop", "train", "--yes", "--url", db_url, cwd=tmp_path))
    assert "no queues" in ok(wq("ls", "--url", db_url, cwd=tmp_path))


def test_url_from_environment(db_url: str, tmp_path: Path) -> None:
    out = ok(wq("upgrade", cwd=tmp_path, env={"WQ_SQL_URL": db_url}))
    assert "(head)" in out
    assert "no queues" in ok(wq("ls", cwd=tmp_path, env={"WQ_SQL_URL": db_url}))
    assert not (tmp_path / "wq_sql.db").exists()


def test_default_url_is_local_sqlite(tmp_path: Path) -> None:
    one_line_error(wq("ls", cwd=tmp_path), "no SQLite file", "wq_sql.db", "upgrade")
    assert not (tmp_path / "wq_sql.db").exists()  # a read command does not create a database
    assert "upgraded from an empty database" in ok(wq("upgrade", cwd=tmp_path))
    assert (tmp_path / "wq_sql.db").exists()
    assert "nothing to do" in ok(wq("upgrade", cwd=tmp_path))


def test_upgrade_creates_schema_in_empty_database(empty_db_url: str, tmp_path: Path) -> None:
    if not empty_db_url.startswith("sqlite"):
        one_line_error(wq("ls", "--url", empty_db_url, cwd=tmp_path), "no wq_sql tables",
                       "python -m wq_sql upgrade")
    assert "upgraded from an empty database" in ok(wq("upgrade", "--url", empty_db_url, cwd=tmp_path))
    assert "(head)" in ok(wq("current", "--url", empty_db_url, cwd=tmp_path))


def test_upgrade_sql_prints_ddl_offline(backend: str, tmp_path: Path) -> None:
    # Nothing listens there (and the SQLite file does not exist): --sql must not connect or create.
    url = (f"sqlite:///{tmp_path / 'never.db'}" if backend == "sqlite"
           else f"postgresql://bob:{PASSWORD}@127.0.0.1:1/nodb")
    args = ["--from", "base"] if backend == "postgresql" else []
    out = ok(wq("upgrade", "--sql", *args, "--url", url, cwd=tmp_path))
    assert "CREATE TABLE wq_items" in out and "CREATE TABLE wq_queues" in out
    assert "CREATE VIEW" in out and "wq_audit" in out and "CREATE TABLE alembic_version" in out
    assert PASSWORD not in out
    assert not (tmp_path / "never.db").exists()
    if backend == "postgresql":
        # Without --from the revision must be read; an unreachable database says how to go offline.
        one_line_error(wq("upgrade", "--sql", "--url", url, cwd=tmp_path), "cannot connect", "--from REV")
        out = ok(wq("upgrade", "--sql", "--from", "base", "--schema", "team_a", "--url", url, cwd=tmp_path))
        assert 'CREATE SCHEMA IF NOT EXISTS "team_a"' in out and "CREATE TABLE wq_items" in out
    one_line_error(wq("upgrade", "--sql", "--from", "0000", "--url", url, cwd=tmp_path),
                   "not a wq_sql schema revision", "0001")
    one_line_error(wq("upgrade", "--from", "0001", "--url", url, cwd=tmp_path), "--sql")


def at_revision(url: str, rev: str, schema: str | None = None) -> None:
    """Build the wq_sql schema of an older revision, as an older wq_sql left it."""
    from alembic import command

    from wq_sql.store import migrate
    from wq_sql.store.engine import make_engine

    engine = make_engine(resolve_url(url), schema=schema)  # its search path puts the tables in schema
    try:
        with engine.begin() as c:
            if schema:
                c.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
            command.upgrade(migrate.alembic_config(c, schema), rev)
    finally:
        engine.dispose()


def apply_sql(url: str, script: str, tmp_path: Path) -> None:
    """Run a printed DDL script as a DBA would: psql / the sqlite3 shell (or the sqlite3 module)."""
    import shutil

    u = resolve_url(url)
    path = tmp_path / "upgrade.sql"
    path.write_text(script, encoding="utf-8")
    if u.get_backend_name() == "sqlite":
        if shutil.which("sqlite3"):
            p = subprocess.run(["sqlite3", "-bail", u.database], stdin=path.open(), capture_output=True,
                               text=True, timeout=60)
            assert p.returncode == 0 and "Error" not in p.stderr, p.stderr
        else:
            import sqlite3

            with sqlite3.connect(u.database) as conn:
                conn.executescript(script)
        return
    libpq = u.set(drivername="postgresql").render_as_string(hide_password=False)
    assert shutil.which("psql"), "psql is needed to apply the printed DDL"
    p = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", libpq, "-f", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "ERROR" not in p.stderr, p.stderr


def statements(script: str) -> list[str]:
    return [ln for ln in script.splitlines() if ln.strip() and not ln.startswith("--")]


@pytest.mark.parametrize("schema", [None, "team_a"])
def test_upgrade_sql_from_an_older_revision_applies_cleanly(empty_db_url: str, backend: str, tmp_path: Path,
                                                            schema: str | None) -> None:
    from wq_sql import WorkQueue
    from wq_sql.store import migrate

    if schema and backend == "sqlite":
        pytest.skip("schemas are PostgreSQL's")
    at_revision(empty_db_url, "0001", schema)
    where = ["--url", empty_db_url] + (["--schema", schema] if schema else [])
    assert "revision 0001;" in ok(wq("current", *where, cwd=tmp_path))
    script = ok(wq("upgrade", "--sql", *where, cwd=tmp_path))
    # Only the steps after 0001: nothing that exists already is created again.
    assert "CREATE TABLE alembic_version" not in script and "CREATE TABLE wq_queues" not in script
    assert "CREATE SCHEMA" not in script
    assert "Running upgrade 0001 -> 0002" in script and f"-> {migrate.head_revision()}" in script
    assert "revision 0001, read from" in script
    # Offline, from --from, the same statements without connecting.
    offline_url = (f"sqlite:///{tmp_path / 'elsewhere.db'}" if backend == "sqlite"
                   else "postgresql://bob@127.0.0.1:1/nodb")
    offline = ok(wq("upgrade", "--sql", "--from", "0001", "--url", offline_url,
                    *(["--schema", schema] if schema else []), cwd=tmp_path))
    assert statements(offline) == statements(script)
    assert not (tmp_path / "elsewhere.db").exists()

    apply_sql(empty_db_url, script, tmp_path)
    assert f"revision {migrate.head_revision()} (head)" in ok(wq("current", *where, cwd=tmp_path))
    at_head = ok(wq("upgrade", "--sql", *where, cwd=tmp_path))
    assert statements(at_head) == [] and "nothing to upgrade" in at_head
    with WorkQueue(["a", "b"], shuffle=False, name="q", url=empty_db_url, schema=schema, worker="w",
                   auto_complete=False) as q:
        first = q.take()
        q.complete(first)
        assert first == "a" and q.progress().done == 1
        q.complete(q.take())
        assert q.progress().done == 2


def test_unknown_queue(db_url: str, tmp_path: Path) -> None:
    ok(wq("upgrade", "--url", db_url, cwd=tmp_path))
    for command in (["status", "nope"], ["reset", "nope", "--yes"], ["drop", "nope", "--yes"],
                    ["audit", "nope"], ["requeue", "nope", "--failed"],
                    ["report", "nope", "--out", "r.html"]):
        one_line_error(wq(*command, "--url", db_url, cwd=tmp_path), "no queue named 'nope'", "ls")


def test_debug_shows_the_traceback(db_url: str, tmp_path: Path) -> None:
    ok(wq("upgrade", "--url", db_url, cwd=tmp_path))
    p = wq("status", "nope", "--url", db_url, "--debug", cwd=tmp_path)
    assert p.returncode != 0 and "Traceback" in p.stderr and "QueueNotFound" in p.stderr


def test_outdated_schema(db_url: str, tmp_path: Path) -> None:
    ok(wq("upgrade", "--url", db_url, cwd=tmp_path))
    engine = sa.create_engine(resolve_url(db_url))
    with engine.begin() as c:
        c.execute(sa.text("UPDATE alembic_version SET version_num = '0000_older'"))
    engine.dispose()
    for args in (["ls"], ["reset", "train", "--yes"]):
        one_line_error(wq(*args, "--url", db_url, cwd=tmp_path), "0000_older", "python -m wq_sql upgrade")
    assert "0000_older" in ok(wq("current", "--url", db_url, cwd=tmp_path))


def test_unreachable_database(tmp_path: Path) -> None:
    url = f"postgresql://bob:{PASSWORD}@127.0.0.1:1/somedb"
    for p in (wq("upgrade", "--url", url, cwd=tmp_path),
              wq("status", "q", cwd=tmp_path, env={"WQ_SQL_URL": url})):
        line = one_line_error(p, "cannot connect to", "127.0.0.1:1", "--url")
        assert PASSWORD not in line and "***" in line


@pytest.mark.parametrize("backend", ["postgresql"])
def test_no_password_in_any_output(db_url: str, tmp_path: Path) -> None:
    # The test server trusts local connections and ignores the password, so every command runs.
    url = sa.engine.make_url(db_url).set(password=PASSWORD).render_as_string(hide_password=False)
    outputs = [wq("upgrade", "--url", url, cwd=tmp_path), wq("current", "--url", url, cwd=tmp_path),
               wq("ls", "--url", url, cwd=tmp_path), wq("status", "nope", "--url", url, cwd=tmp_path),
               wq("upgrade", "--sql", "--url", url, cwd=tmp_path)]
    assert outputs[0].returncode == 0 and "***" in outputs[0].stdout
    one_line_error(outputs[3], "no queue named 'nope'", "***")
    for p in outputs:
        assert PASSWORD not in p.stdout + p.stderr
    engine = sa.create_engine(resolve_url(db_url))
    with engine.begin() as c:
        c.execute(sa.text("UPDATE alembic_version SET version_num = '0000_older'"))
    engine.dispose()
    line = one_line_error(wq("ls", "--url", url, cwd=tmp_path), "python -m wq_sql upgrade")
    assert PASSWORD not in line and "***" in line


def test_sqlite_path_errors(tmp_path: Path) -> None:
    missing_dir = f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'wq.db'}"
    for command in (["upgrade"], ["status", "q"]):
        one_line_error(wq(*command, "--url", missing_dir, cwd=tmp_path), "does not exist", "create it")
    missing_file = f"sqlite:///{tmp_path / 'typo.db'}"
    for command in (["current"], ["drop", "q", "--yes"]):
        one_line_error(wq(*command, "--url", missing_file, cwd=tmp_path), "no SQLite file", "upgrade")
    assert not (tmp_path / "typo.db").exists()


def test_usage_errors(tmp_path: Path) -> None:
    p = wq(cwd=tmp_path)
    assert p.returncode == 2 and "usage: wq-sql" in p.stderr
    p = wq("--url", "not a url", "ls", cwd=tmp_path)
    one_line_error(p, "not a database URL")


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The command in this process (fast; the acceptance tests run it as a subprocess)."""
    from wq_sql.cli import main

    rc = main(list(args))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_the_commands_connect_timeout_is_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The command bounds its Postgres connects (``PGCONNECT_TIMEOUT``) while it runs, and leaves a
    program that calls ``main()`` its own setting: unset stays unset, a value stays that value."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    assert run_cli(capsys, "upgrade", "--url", url)[0] == 0
    assert "PGCONNECT_TIMEOUT" not in os.environ
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "30")
    assert run_cli(capsys, "ls", "--url", url)[0] == 0
    assert os.environ["PGCONNECT_TIMEOUT"] == "30"


def test_requeue_expired_and_done_keep_the_counters_right(db_url: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from worker_proc import query, query_commit

    from wq_sql import QueueExhausted, WorkQueue

    wq_ = WorkQueue([f"w{i}" for i in range(6)], num_epochs=2, shuffle=False, name="train", url=db_url,
                    worker="alice", lease_ahead=1, claim_ahead=False)  # the exact histories below
    items = [wq_.take() for _ in range(4)]  # 3 done, the 4th claimed
    other = WorkQueue.attach("train", url=db_url, worker="bob", lease_ahead=1, claim_ahead=False)
    other_item = other.take()  # claimed, its lease is live: --expired leaves it alone
    query_commit(db_url, "UPDATE wq_items SET lease_until = :t WHERE id = :i", t="2000-01-01 00:00:00.000000",
                 i=items[-1].item_id)
    rc, out, _ = run_cli(capsys, "requeue", "train", "--expired", "--url", db_url)
    assert rc == 0 and "requeued 1 item(s)" in out and "expired lease" in out
    assert wq_.progress().done == 3
    other.release(other_item)
    other.close()
    rc, out, err = run_cli(capsys, "requeue", "train", "--done", "--epoch", "0", "--url", db_url)
    assert rc == 0 and "requeued 3 item(s) of epoch 0" in out
    assert wq_.progress().done == 0
    assert query(db_url, "SELECT sum(n_done) FROM wq_tallies")[0][0] == 0
    rc, _, err = run_cli(capsys, "requeue", "train", "--worker", "carol", "--url", db_url)
    assert rc == 1 and "no worker named 'carol'" in err
    rc, out, err = run_cli(capsys, "requeue", "train", "--worker", "alice", "--url", db_url)
    assert rc == 0 and "requeued 0 item(s)" in out
    seen = [str(wq_.take()) for _ in range(12)]  # everything comes round again, then finishes
    assert sorted(seen) == sorted([f"w{i}" for i in range(6)] * 2)
    with pytest.raises(QueueExhausted) as exc:
        wq_.take()
    assert (exc.value.done, exc.value.failed) == (12, 0)
    wq_.close()
    rc, out, _ = run_cli(capsys, "audit", "train", "--url", db_url)
    assert rc == 0 and "exactly-once: OK" in out and "re-delivered items: 5" in out
    kinds = [r.kind for r in query(db_url, "SELECT kind FROM wq_history WHERE epoch = 0 AND seq = 3 "
                                           "ORDER BY event_id")]
    assert kinds == ["claim", "requeue", "claim", "done"]


def test_create_from_globs_and_literal_works(db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from wq_sql import QueueConfigMismatch, WorkQueue

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("b.parquet", "a.parquet", "c.txt"):
        (tmp_path / "data" / name).touch()
    rc, out, _ = run_cli(capsys, "create", "q", "--works", "data/*.parquet", "hdfs://nn/x", "--no-shuffle",
                         "--epochs", "2", "--url", db_url)
    assert rc == 0 and "created queue 'q'" in out and "3 items per epoch, 2 epoch(s), in order" in out
    rc, out, _ = run_cli(capsys, "create", "q", "--works", "data/*.parquet", "hdfs://nn/x", "--no-shuffle",
                         "--epochs", "2", "--url", db_url)
    assert rc == 0 and "already exists with this configuration" in out
    works = ["data/a.parquet", "data/b.parquet", "hdfs://nn/x"]  # globs sorted, literals kept
    with WorkQueue(works, num_epochs=2, shuffle=False, name="q", url=db_url, worker="w") as wq_:
        assert [str(wq_.take()) for _ in range(3)] == works
    with pytest.raises(QueueConfigMismatch):
        WorkQueue(works, num_epochs=2, shuffle=True, name="q", url=db_url, worker="w")
    rc, _, err = run_cli(capsys, "create", "q", "--works", *works, "--epochs", "3", "--url", db_url)
    assert rc == 1 and "exists with another configuration" in err and "num_epochs: stored 2, given 3" in err
    assert len(err.splitlines()) == 1
    rc, _, err = run_cli(capsys, "create", "q2", "--works", "data/*.csv", "--url", db_url)
    assert rc == 1 and "matches no file" in err and "quote the pattern" in err
    rc, _, err = run_cli(capsys, "create", "q2", "--works", "a", "--epochs", "0", "--url", db_url)
    assert rc == 1 and "num_epochs must be a positive int" in err
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    rc, _, err = run_cli(capsys, "create", "q2", "--works-from", "empty.txt", "--url", db_url)
    assert rc == 1 and "lists no works" in err


def test_extend_raises_num_epochs_and_the_mismatch_hint_names_it(db_url: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from wq_sql import QueueExhausted, WorkQueue

    rc, out, _ = run_cli(capsys, "create", "q", "--works", "a", "b", "--no-shuffle", "--max-attempts", "2",
                         "--url", db_url)
    assert rc == 0 and "max 2 attempts" in out
    with WorkQueue(["a", "b"], shuffle=False, name="q", url=db_url, worker="w") as wq_:
        assert [str(i) for i in wq_] == ["a", "b"]
    rc, _, err = run_cli(capsys, "create", "q", "--works", "a", "b", "--no-shuffle", "--epochs", "3",
                         "--url", db_url)
    assert rc == 1 and "num_epochs: stored 1, given 3" in err
    assert "python -m wq_sql extend q --epochs 3" in err and len(err.splitlines()) == 1
    rc, _, err = run_cli(capsys, "create", "q", "--works", "a", "b", "--no-shuffle", "--max-attempts", "5",
                         "--url", db_url)
    assert rc == 1 and "max_attempts: stored 2, given 5" in err

    rc, out, _ = run_cli(capsys, "extend", "q", "--epochs", "3", "--url", db_url)
    assert rc == 0 and "num_epochs 1 -> 3" in out
    rc, out, _ = run_cli(capsys, "extend", "q", "--epochs", "3", "--url", db_url)
    assert rc == 0 and "has 3 epoch(s) already; nothing to do" in out
    rc, _, err = run_cli(capsys, "extend", "q", "--epochs", "2", "--url", db_url)
    assert rc == 1 and "can only grow" in err and "at least 3" in err
    rc, _, err = run_cli(capsys, "extend", "q", "--epochs", "0", "--url", db_url)
    assert rc == 1 and "num_epochs must be a positive int" in err
    rc, _, err = run_cli(capsys, "extend", "nope", "--epochs", "2", "--url", db_url)
    assert rc == 1 and "no queue named 'nope'" in err
    rc, out, _ = run_cli(capsys, "create", "q", "--works", "a", "b", "--no-shuffle", "--epochs", "3",
                         "--url", db_url)
    assert rc == 0 and "already exists with this configuration" in out
    # A worker joins with the new num_epochs and gets the two new epochs, then the end.
    with WorkQueue(["a", "b"], num_epochs=3, shuffle=False, name="q", url=db_url, worker="w") as wq_:
        assert wq_.max_attempts == 2
        assert [str(wq_.take()) for _ in range(4)] == ["a", "b", "a", "b"]
        with pytest.raises(QueueExhausted) as ei:
            wq_.take()
        assert ei.value.done == 6


def test_long_works_and_errors_are_cut_in_human_output_and_whole_in_json(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from worker_proc import query_commit

    from wq_sql import WorkQueue

    big_work, big_error, prefix = "w" * 1_000_000, "E" * 1_000_000 + "\nat line 2", "/d/" + "p" * 100_000
    with WorkQueue([big_work, "ok"], shuffle=False, prefix=prefix, name="q", url=db_url, worker="w",
                   max_attempts=1, auto_complete=False) as wq_:
        wq_.release(wq_.take())  # delivered twice: a re-delivery
        wq_.fail(wq_.take(), big_error)
        wq_.complete(wq_.take())
    # fail() keeps the first 10,000 characters of an error; other writers may store more.
    query_commit(db_url, "UPDATE wq_items SET last_error = :e WHERE state = 'failed'", e=big_error)
    rc, out, _ = run_cli(capsys, "audit", "q", "--url", db_url)
    assert rc == 0 and len(out) < 5_000, len(out)
    assert "w" * 77 + "..." in out and "E" * 77 + "..." in out and "at line 2" not in out
    assert "values cut to 80 characters" in out and "python -m wq_sql audit q --format json" in out
    rc, out, _ = run_cli(capsys, "audit", "q", "--format", "json", "--url", db_url)
    a = json.loads(out)
    assert a["failed"][0]["work"] == big_work and a["failed"][0]["last_error"] == big_error
    assert a["redeliveries"][0]["work"] == big_work
    rc, out, _ = run_cli(capsys, "audit", "q", "--format", "csv", "--url", db_url)
    assert big_work in out and "E" * 1_000_000 in out
    for command in ("status", "ls"):
        rc, out, _ = run_cli(capsys, command, *(["q"] if command == "status" else []), "--url", db_url)
        assert rc == 0 and len(out) < 3_000, (command, len(out))
        assert "/d/ppp" in out and "p" * 200 not in out
    assert "SELECT name, prefix FROM wq_queues" in out  # ls says where the full prefix is
    # Short values are shown whole, with no note.
    with WorkQueue(["short"], name="q2", url=db_url, worker="w", max_attempts=1) as wq_:
        wq_.fail(wq_.take(), "boom")
    rc, out, _ = run_cli(capsys, "audit", "q2", "--url", db_url)
    assert "short" in out and "boom" in out and "values cut" not in out


def test_status_reports_one_item_done_and_each_workers_last_minute(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from worker_proc import query_commit

    from wq_sql import WorkQueue

    def status() -> tuple[str, dict[str, list[str]]]:
        rc, out, _ = run_cli(capsys, "status", "q", "--url", db_url)
        assert rc == 0
        return out, table(out, "WORKER")  # ... HOLDING DONE FAILED DONE/MIN

    works = [f"w{i}" for i in range(10)]
    one = {"lease_ahead": 1, "claim_ahead": False}  # one item per round, none ahead: exact counts
    with WorkQueue(works, shuffle=False, name="q", url=db_url, worker="alice", auto_complete=False,
                   **one) as a, \
         WorkQueue.attach("q", url=db_url, worker="bob", auto_complete=False, **one) as b:
        out, _ = status()
        assert "throughput: no item done in the last minute  ETA -" in out
        a.complete(a.take())
        out, workers = status()
        assert "throughput: 1 item done in the last minute (a rate needs two)  ETA -" in out
        assert workers["alice"][-4:] == ["0", "1", "0", "1"] and workers["bob"][-4:] == ["0", "0", "0", "0"]
        for _ in range(3):
            b.complete(b.take())
        a.complete(a.take())
        held = b.take()
        out, workers = status()
        assert re.search(r"throughput: [0-9.]+ items/s \(5 done in the last minute\)  ETA \d", out), out
        assert workers["alice"][-4:] == ["0", "2", "0", "2"] and workers["bob"][-4:] == ["1", "3", "0", "3"]
        # Items done more than a minute ago count as done, not in the last minute.
        query_commit(db_url, "UPDATE wq_events SET at = :t WHERE kind = 'done' AND worker_id = "
                             "(SELECT id FROM wq_workers WHERE name = 'bob')", t="2000-01-01 00:00:00.000000")
        out, workers = status()
        assert "(2 done in the last minute)" in out
        assert workers["bob"][-4:] == ["1", "3", "0", "0"] and workers["alice"][-1] == "2"
        b.release(held)


def test_status_splits_buffered_from_holding_and_marks_stale_workers(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    import time

    from worker_proc import query, query_commit

    from wq_sql import WorkQueue

    works = [f"w{i}" for i in range(10)]
    with WorkQueue(works, shuffle=False, name="q", url=db_url, worker="alice", lease_ahead=3,
                   heartbeat_seconds=0.3, claim_ahead=False) as a, \
         WorkQueue.attach("q", url=db_url, worker="bob", heartbeat_seconds=20, lease_ahead=1,
                          claim_ahead=False) as b:
        a.take()
        b.take()
        deadline = time.monotonic() + 30
        while query(db_url, "SELECT buffered FROM wq_workers WHERE name = 'alice'") != [(2,)]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        rc, out, _ = run_cli(capsys, "status", "q", "--url", db_url)
        workers = table(out, "WORKER")
        assert workers["alice"][-5:] == ["2", "1", "0", "0", "0"], out  # BUFFERED HOLDING DONE ...
        assert workers["bob"][-5:] == ["0", "1", "0", "0", "0"], out
        assert "STALE" not in out
        query_commit(db_url, "UPDATE wq_workers SET heartbeat_at = :t WHERE name = 'bob'",
                     t="2000-01-01 00:00:00.000000")
        rc, out, _ = run_cli(capsys, "status", "q", "--url", db_url)
        assert rc == 0 and "STALE" in table(out, "WORKER")["bob"], out
        assert "STALE: 'bob' stopped heartbeating" in out and "wq-sql requeue q --worker bob" in out
        # alice's next heartbeat returns bob's item, with a WARNING naming bob.
        deadline = time.monotonic() + 30
        while query(db_url, "SELECT count(*) FROM wq_history WHERE kind = 'expire'") != [(1,)]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        detail = query(db_url, "SELECT detail FROM wq_history WHERE kind = 'expire'")[0][0]
        assert detail.startswith("worker 'bob' stopped heartbeating"), detail


def test_create_notes_relative_paths(db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from worker_proc import query_commit

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "data" / name).write_text("x\n")
    query_commit(db_url, "CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
    query_commit(db_url, "INSERT INTO t (id, v) VALUES (1, 'a'), (2, 'b')")
    rc, out, err = run_cli(capsys, "create", "rel", "--works", "data/*.txt", "hdfs://nn/x", "table:t",
                           "lines:data/a.txt", str(tmp_path / "data" / "b.txt"), "--url", db_url)
    assert rc == 0 and "created queue 'rel'" in out
    lines = err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("note: 3 of 6 works are relative paths (e.g. 'data/a.txt')")
    assert "relative to its own working directory" in err and str(tmp_path) in err
    # Absolute paths, URLs, tables, or a prefix that makes them absolute: no note.
    for name, works in (("abs", [str(tmp_path / "data" / "a.txt"), "s3://b/k", "table:t"]),
                        ("pre", ["--prefix", "/mnt/data/", "--works", "a.txt"])):
        args = works if name == "pre" else ["--works", *works]
        rc, out, err = run_cli(capsys, "create", name, *args, "--url", db_url)
        assert rc == 0 and "created queue" in out and err == ""
    with pytest.raises(SystemExit):
        run_cli(capsys, "create", "--help")
    assert "relative to its own working directory" in " ".join(capsys.readouterr().out.split())


def test_report_png_and_missing_matplotlib(db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from wq_sql import WorkQueue

    with WorkQueue([f"w{i}" for i in range(5)], name="q", url=db_url, worker="alice") as wq_:
        for _ in wq_:
            pass
    rc, _, err = run_cli(capsys, "report", "q", "--out", str(tmp_path / "t.pdf"), "--url", db_url)
    assert rc == 1 and "FILE.html" in err
    rc, out, _ = run_cli(capsys, "report", "q", "--out", str(tmp_path / "t.svg"), "--url", db_url)
    assert rc == 0 and "1 worker lane(s), 5 deliveries, 0 re-deliveries" in out
    assert (tmp_path / "t.svg").read_text().startswith("<svg")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "matplotlib", None)  # as if not installed
        rc, _, err = run_cli(capsys, "report", "q", "--out", str(tmp_path / "t.png"), "--url", db_url)
        assert rc == 1 and "pip install 'wq_sql[plot]'" in err and len(err.splitlines()) == 1
    pytest.importorskip("matplotlib", reason="the PNG report needs the [plot] extra (matplotlib)")
    rc, out, err = run_cli(capsys, "report", "q", "--out", str(tmp_path / "t.png"), "--url", db_url)
    assert rc == 0, err
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_pairs_each_delivery_with_what_ended_it() -> None:
    import datetime as dt

    from wq_sql.monitor.report import Event, pair_deliveries

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    kinds = [(1, "claim", "a"), (2, "claim", "b"), (1, "recover", "a"), (2, "expire", "b"), (2, "claim", "c"),
             (1, "done", "a"), (3, "claim", "a"), (2, "release", "c"), (2, "claim", "a")]
    events = [Event(k, item, 0, item, kind, who, t0 + dt.timedelta(seconds=k), None)
              for k, (item, kind, who) in enumerate(kinds)]
    bars = [(b.item_id, b.worker, b.end_kind, b.redelivery) for b in pair_deliveries(events)]
    assert bars == [(1, "a", "recover", False), (2, "b", "expire", False), (1, "a", "done", True),
                    (2, "c", "release", True), (3, "a", None, False), (2, "a", None, True)]


def test_migrate_alias_and_busy_sqlite_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import sqlite3

    from wq_sql.cli import _describe

    url = f"sqlite:///{tmp_path / 'wq.db'}"
    rc, out, _ = run_cli(capsys, "migrate", "--url", url)
    assert rc == 0 and "upgraded from an empty database" in out
    busy = sa.exc.OperationalError("UPDATE wq_items ...", {}, sqlite3.OperationalError("database is locked"))
    line = _describe(busy)
    assert "stayed locked" in line and "retry" in line and "\n" not in line
