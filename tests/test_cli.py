"""Acceptance tests: the real ``python -m wq_sql`` command as a subprocess, on both backends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from wq_sql.engine import resolve_url

ROOT = Path(__file__).resolve().parent.parent
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
               url=sys.argv[1], worker="alice")
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
        assert workers["alice"][-3:] == ["1", "3", "0"]  # holding done failed
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
    # Nothing listens there: --sql must not connect.
    url = (f"sqlite:///{tmp_path / 'never.db'}" if backend == "sqlite"
           else f"postgresql://bob:{PASSWORD}@127.0.0.1:1/nodb")
    out = ok(wq("upgrade", "--sql", "--url", url, cwd=tmp_path))
    assert "CREATE TABLE wq_items" in out and "CREATE TABLE wq_queues" in out
    assert "CREATE VIEW" in out and "wq_audit" in out and "alembic_version" in out
    assert PASSWORD not in out
    assert not (tmp_path / "never.db").exists()
    if backend == "postgresql":
        out = ok(wq("upgrade", "--sql", "--schema", "team_a", "--url", url, cwd=tmp_path))
        assert 'CREATE SCHEMA IF NOT EXISTS "team_a"' in out and "CREATE TABLE wq_items" in out


def test_unknown_queue(db_url: str, tmp_path: Path) -> None:
    ok(wq("upgrade", "--url", db_url, cwd=tmp_path))
    for command in (["status", "nope"], ["reset", "nope", "--yes"], ["drop", "nope", "--yes"]):
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
