"""A database that cannot be reached or opened: every entry point that opens one raises
:class:`DatabaseUnavailable` at once (no retrying of a first connection), with one line that names
the fix and never the password, the driver's error chained; the CLI prints the same line. A
database this queue object had reached is still waited for, up to ``busy_timeout``.

Also the URL and name mistakes a newcomer makes first: ``sqlite://jobs.db`` (a slash missing) and
a queue name of only whitespace.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import sqlalchemy as sa
from pgcluster import PgCluster, PgClusterError  # noqa: E402
from sqlalchemy.engine import make_url

import wq_sql
from wq_sql import DatabaseUnavailable, InvalidInput, WorkQueue, WqSqlError
from wq_sql import cli as wq_cli
from wq_sql.admin import create_queue

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "S3cr3tPw"
# From the call to the exception: a failure to connect is not retried, so this is generous.
FAST = 2.0

Opener = Callable[[str], Any]
OPENERS: dict[str, Opener] = {
    "WorkQueue": lambda u: WorkQueue(["a", "b"], name="q", url=u, worker="w"),
    "WorkQueue.attach": lambda u: WorkQueue.attach("q", url=u, worker="w"),
    "upgrade": wq_sql.upgrade,
    "list_queues": wq_sql.list_queues,
    "reset_queue": lambda u: wq_sql.reset_queue("q", u),
    "drop_queue": lambda u: wq_sql.drop_queue("q", u),
    "compact_queue": lambda u: wq_sql.compact_queue("q", u),
    "create_queue": lambda u: create_queue(["a"], name="q", url=u),
}
# What a read-only SQLite database refuses: the calls that write (the others only read there).
WRITERS = ["WorkQueue", "WorkQueue.attach", "reset_queue", "drop_queue"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def with_password(url: str, **parts: Any) -> str:
    return make_url(url).set(password=PASSWORD, **parts).render_as_string(hide_password=False)


def unavailable(call: Opener, url: str, *needles: str, cause: bool = True) -> DatabaseUnavailable:
    """``call(url)`` raises DatabaseUnavailable within FAST seconds: one line holding ``needles``,
    no password anywhere a user may see it, the driver's error chained (``cause``)."""
    t0 = time.monotonic()
    with pytest.raises(DatabaseUnavailable) as info:
        call(url)
    elapsed = time.monotonic() - t0
    e = info.value
    msg = str(e)
    assert isinstance(e, WqSqlError)
    assert msg and "\n" not in msg and msg == msg.strip(), msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    shown = "\n".join([msg, repr(e), "".join(traceback.format_exception(e))])
    assert PASSWORD not in shown, shown
    if cause:
        assert isinstance(e.__cause__, sa.exc.DBAPIError), repr(e.__cause__)
    assert elapsed < FAST, f"{elapsed:.2f}s until {msg!r}"
    return e


# ---------------------------------------------------------------- Postgres


@pytest.mark.parametrize("backend", ["postgresql"])
@pytest.mark.parametrize(("case", "needles"), [
    ("refused port", ("start the server", "check the host and port")),
    ("unknown host", ("wq-sql-no-such-host.invalid", "check the host name")),
    ("missing database", ("createdb wq_sql_no_such_database",)),
    ("unknown role", ("wq_sql_no_such_role", "fix the user name")),
])
def test_postgres_that_cannot_be_reached(db_url: str, case: str, needles: tuple[str, ...]) -> None:
    parts: dict[str, Any] = {
        "refused port": {"port": free_port()},
        "unknown host": {"host": "wq-sql-no-such-host.invalid"},
        "missing database": {"database": "wq_sql_no_such_database"},
        "unknown role": {"username": "wq_sql_no_such_role"},
    }[case]
    url = with_password(db_url, **parts)
    shown = make_url(url).set(drivername="postgresql+psycopg2").render_as_string(hide_password=True)
    for name, call in OPENERS.items():
        e = unavailable(call, url, *needles)
        assert f"cannot connect to {shown}:" in str(e), (name, str(e))


# ---------------------------------------------------------------- SQLite


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def test_sqlite_folder_as_path(tmp_path: Path) -> None:
    folder = tmp_path / "a folder"
    folder.mkdir()
    for call in OPENERS.values():
        unavailable(call, sqlite_url(folder), f"{str(folder)!r} is a folder", "sqlite:///")
    assert list(folder.iterdir()) == []


def test_sqlite_file_that_is_not_a_database(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    content = "these are notes, not a SQLite database; nobody may overwrite them\n" * 20
    text.write_text(content)
    for call in OPENERS.values():
        unavailable(call, sqlite_url(text), f"{str(text)!r} is not a SQLite database")
    assert text.read_text() == content


def test_sqlite_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "folder"
    for call in OPENERS.values():
        unavailable(call, sqlite_url(missing / "q.db"), str(missing), "does not exist; create it first",
                    cause=False)
    assert not (tmp_path / "no").exists()


@pytest.fixture
def immutable(tmp_path: Path) -> Iterator[Path]:
    """A wq_sql database with queue ``q`` that nobody may write, root included (``chattr +i``:
    root ignores file permissions)."""
    path = tmp_path / "ro.db"
    WorkQueue(["a", "b"], name="q", url=sqlite_url(path), worker="maker").close()
    p = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot make a read-only file here (chattr +i: {p.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_sqlite_read_only_file(immutable: Path) -> None:
    url = sqlite_url(immutable)
    for name in WRITERS:
        unavailable(OPENERS[name], url, "is read-only", "make the file and its folder writable")
    assert [q["name"] for q in wq_sql.list_queues(url)] == ["q"]  # reading still works


# ---------------------------------------------------------------- the CLI: the same lines


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = wq_cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("backend", ["postgresql"])
def test_cli_prints_the_same_line_with_a_pasteable_url(empty_db_url: str, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """User ``postgres`` with password ``postgres``: the URLs in the error lines are the given ones
    with only the password masked, so the suggested command can be pasted."""
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "10")
    given = make_url(empty_db_url).set(username="postgres", password="postgres")
    refused = given.set(port=free_port())
    t0 = time.monotonic()
    rc, out, err = run_cli(capsys, "ls", "--url", refused.render_as_string(hide_password=False))
    assert time.monotonic() - t0 < FAST
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    shown = f"postgresql+psycopg2://postgres:***@127.0.0.1:{refused.port}/{given.database}"
    assert f"cannot connect to {shown}: " in err and "start the server" in err, err
    assert "postgres:postgres" not in err and "***ql" not in err, err
    with pytest.raises(DatabaseUnavailable) as info:
        wq_sql.list_queues(refused)
    # The same line as the API's error, but for where the URL was given.
    assert str(info.value).replace("url= (or $WQ_SQL_URL)", "--url (or $WQ_SQL_URL)") in err

    # A database without wq_sql's tables: the suggested command runs as printed, password aside.
    rc, out, err = run_cli(capsys, "ls", "--url", given.render_as_string(hide_password=False))
    suggested = f"upgrade --url 'postgresql+psycopg2://postgres:***@127.0.0.1:{given.port}/{given.database}'"
    assert rc == 1 and suggested in err and "postgres:postgres" not in err, err
    rc, out, err = run_cli(capsys, *suggested.replace("'", "").replace("***", "postgres").split())
    assert rc == 0 and "upgraded" in out, (out, err)


def test_cli_sqlite_open_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "a folder"
    folder.mkdir()
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n" * 50)
    for path, needle in [(folder, "is a folder"), (text, "is not a SQLite database")]:
        for command in (["upgrade"], ["ls"], ["status", "q"], ["drop", "q", "--yes"]):
            rc, out, err = run_cli(capsys, *command, "--url", sqlite_url(path))
            assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
            assert needle in err and "Traceback" not in err, err


# ---------------------------------------------------------------- what a password looks like


def test_mask_secrets_hides_passwords_by_structure_only() -> None:
    from wq_sql.store.redact import mask_secrets

    hidden = {
        "postgresql+psycopg2://postgres:postgres@127.0.0.1:5433/db":
            "postgresql+psycopg2://postgres:***@127.0.0.1:5433/db",
        "dsn: host=h user=postgres password=postgres dbname=db":
            "dsn: host=h user=postgres password=*** dbname=db",
        "invalid dsn: password='a b\\'c' host=h": "invalid dsn: password=*** host=h",
        "u=x postgresql://u:p:a/s%40s@h/db end": "u=x postgresql://u:***@h/db end",
        "unterminated password='never closed": "unterminated password=***",
    }
    for text, masked in hidden.items():
        assert mask_secrets(text) == masked
    # The password's text elsewhere is no password: user names, hosts, schemes stay as they are.
    for text in ("role \"postgres\" does not exist", "postgresql://postgres@127.0.0.1:5433/postgres",
                 "connection to server at \"127.0.0.1\", port 5433 failed: Connection refused"):
        assert mask_secrets(text) == text


# ---------------------------------------------------------------- a real server: password, outages


@pytest.fixture(scope="module")
def cluster() -> Iterator[PgCluster]:
    """A throwaway server (tests/support/pgcluster.py) that this module may stop, and whose role
    ``wq_pw`` must give its password (the shared test server trusts every local connection)."""
    pg: Optional[PgCluster] = None
    try:
        pg = PgCluster({"fsync": "off"})
        pg.start()
    except (PgClusterError, OSError) as e:
        if pg is not None:
            pg.close()
        if os.environ.get("CI"):
            pytest.fail(f"cannot make a throwaway PostgreSQL cluster: {e}", pytrace=False)
        pytest.skip(f"cannot make a throwaway PostgreSQL cluster: {e}")
    try:
        hba = pg.data_dir / "pg_hba.conf"
        hba.write_text("host all wq_pw 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
        pg.sql("CREATE ROLE wq_pw LOGIN PASSWORD 'right-password'")
        pg.sql("SELECT pg_reload_conf()")
        yield pg
    finally:
        pg.close()


def test_wrong_password(cluster: PgCluster) -> None:
    url = make_url(cluster.url()).set(username="wq_pw", password=PASSWORD).render_as_string(
        hide_password=False)
    for call in OPENERS.values():
        unavailable(call, url, "password authentication failed", "check the user and password")


def test_an_outage_of_a_reached_database_is_ridden_out(cluster: PgCluster,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The server stops under a queue that had connected: a take() waits for it (up to
    ``busy_timeout``), and one that waits longer raises DatabaseUnavailable saying so."""
    caplog.set_level(logging.WARNING, logger="wq_sql")
    url = cluster.create_database(f"outage_{uuid.uuid4().hex[:8]}")
    wq = WorkQueue([f"w{i}" for i in range(6)], name="q", url=url, worker="w", busy_timeout=20,
                   shuffle=False)
    other: Optional[WorkQueue] = None
    try:
        assert wq.take() == "w0"
        cluster.stop("fast")
        restart = threading.Timer(1.5, cluster.start)
        restart.start()
        t0 = time.monotonic()
        assert wq.take() == "w1"  # waited for the server
        restart.join()
        assert time.monotonic() - t0 >= 1.0
        assert "database connection lost" in caplog.text

        # A worker whose busy_timeout runs out meanwhile says so.
        other = WorkQueue.attach("q", url=url, worker="w2", busy_timeout=1.0)
        assert other.take() == "w2"
        cluster.stop("fast")
        t0 = time.monotonic()
        with pytest.raises(DatabaseUnavailable) as info:
            other.take()
        assert 1.0 <= time.monotonic() - t0 < 5.0
        msg = str(info.value)
        assert "\n" not in msg and "busy_timeout" in msg and "cannot connect to" in msg, msg
        assert isinstance(info.value.__cause__, sa.exc.DBAPIError)
    finally:
        cluster.start()
        wq.close()
        if other is not None:
            other.close()


# ---------------------------------------------------------------- URL and name mistakes


@pytest.mark.parametrize(("url", "suggested"), [
    ("sqlite://jobs.db", "sqlite:///jobs.db"),
    ("sqlite://data/jobs.db", "sqlite:///data/jobs.db"),
])
def test_sqlite_url_with_two_slashes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch, url: str, suggested: str) -> None:
    monkeypatch.chdir(tmp_path)
    for call in OPENERS.values():
        with pytest.raises(InvalidInput) as info:
            call(url)
        msg = str(info.value)
        assert "slash is probably missing" in msg and suggested in msg and "sqlite:////" in msg, msg
    rc, out, err = run_cli(capsys, "ls", "--url", url)
    assert rc == 1 and suggested in err and "slash is probably missing" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", [" ", "   ", "\t\n", "\u00a0", "\u200b", " \u3000 "])
def test_queue_name_of_only_whitespace_is_refused(db_url: str, capsys: pytest.CaptureFixture[str],
                                                  name: str) -> None:
    for call in (lambda: WorkQueue(["a"], name=name, url=db_url, worker="w"),
                 lambda: WorkQueue.attach(name, url=db_url, worker="w"),
                 lambda: create_queue(["a"], name=name, url=db_url)):
        with pytest.raises(InvalidInput, match="name must contain a visible character"):
            call()
    rc, out, err = run_cli(capsys, "create", name, "--works", "a", "--url", db_url)
    assert rc == 1 and "name must contain a visible character" in err, err
    assert wq_sql.list_queues(db_url) == []
    # Names with a visible character stay data, spaces included.
    with WorkQueue(["a"], name=" q ", url=db_url, worker="w") as wq:
        assert wq.take() == "a"
    assert [q["name"] for q in wq_sql.list_queues(db_url)] == [" q "]
