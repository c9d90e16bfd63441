"""Security: a database password never shows, and user text reaches SQL only as bound parameters.

The test server trusts local connections, so a URL with any password connects; the password in
these tests has characters that URLs quote (``: / @ %``), and every check looks for its
distinctive core, which both the raw and the quoted form contain.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine, event
from sqlalchemy.engine import make_url

import wq_sql
from wq_sql import QueueConfigMismatch, QueueExhausted, QueueNotFound, WorkQueue, WqSqlError
from wq_sql import cli as wq_cli
from wq_sql.admin import create_queue
from wq_sql.store.engine import make_engine, resolve_url

ROOT = Path(__file__).resolve().parents[2]
CORE = "S3cr3tPw"
PASSWORD = f"{CORE}:/@%x"


def with_password(url: str, **parts: Any) -> str:
    return make_url(url).set(password=PASSWORD, **parts).render_as_string(hide_password=False)


def assert_hidden(text: str, where: str) -> None:
    assert CORE not in text, f"the password shows in {where}:\n{text}"


def error_texts(e: BaseException) -> str:
    """Everything a user may see of an exception: str, repr and the full traceback with causes."""
    return "\n".join([str(e), repr(e), "".join(traceback.format_exception(e))])


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """wq_sql's and SQLAlchemy's loggers (engine statements and parameters, pool connections) at
    DEBUG."""
    for name in ("wq_sql", "sqlalchemy"):
        caplog.set_level(logging.DEBUG, logger=name)
    yield caplog


def all_logged(caplog: pytest.LogCaptureFixture) -> str:
    return caplog.text + "\n".join(f"{r.getMessage()} {r.args!r} {r.exc_text or ''}" for r in caplog.records)


# ---------------------------------------------------------------- passwords, in the library


@pytest.mark.parametrize("backend", ["postgresql"])
def test_library_never_shows_the_password(db_url: str, debug_logs: pytest.LogCaptureFixture,
                                          capfd: pytest.CaptureFixture[str]) -> None:
    url = with_password(db_url)
    seen: list[str] = []
    errors: list[BaseException] = []

    def expect(exc: type[BaseException], fn: Any, *args: Any, **kw: Any) -> None:
        with pytest.raises(exc) as info:
            fn(*args, **kw)
        errors.append(info.value)

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert wq_sql.upgrade(url)
        with WorkQueue(["a", "b", "c"], num_epochs=2, name="train", url=url, worker="w1",
                       max_attempts=1, lease_ahead=2) as wq:
            first = wq.take()
            wq.fail(first, "boom")
            many = wq.take_many(2)
            wq.prefetch()
            progress = wq.progress()
            seen += [repr(wq), str(wq), repr(first), repr(many), repr(progress), repr(wq.engine.url),
                     str(wq.engine.url), repr(wq.engine)]
            expect(QueueConfigMismatch, WorkQueue, ["other"], name="train", url=url, worker="w2")
            expect(wq_sql.WorkerConflict, WorkQueue.attach, "train", url=url, worker="w1")
            for _ in wq:
                pass
            expect(QueueExhausted, wq.take)
        expect(WqSqlError, wq.take)  # closed
        expect(QueueNotFound, WorkQueue.attach, "nope", url=url, worker="w3")
        expect(QueueNotFound, wq_sql.reset_queue, "nope", url)
        seen += [repr(wq_sql.list_queues(url)), repr(create_queue(["x"], name="other", url=url))]
        wq_sql.compact_queue("train", url)
        wq_sql.reset_queue("train", url)
        assert wq_sql.drop_queue("train", url)
        # An outdated schema names the command to run, with the URL: without its password.
        engine = sa.create_engine(resolve_url(db_url))
        with engine.begin() as c:
            c.execute(sa.text("UPDATE alembic_version SET version_num = '0000_older'"))
        engine.dispose()
        expect(wq_sql.SchemaOutdated, WorkQueue, ["a"], name="train", url=url, worker="w1")
        expect(wq_sql.SchemaOutdated, wq_sql.list_queues, url)
        # A URL wq_sql cannot parse is not echoed back.
        expect(wq_sql.InvalidInput, WorkQueue, ["a"], url=f"postgresql://u:{PASSWORD}@h:port/db")

    assert "***" in repr(wq) and "***" in str(errors[-2])  # the URL shows, its password masked
    for text in seen:
        assert_hidden(text, "a repr")
    for e in errors:
        assert_hidden(error_texts(e), f"a {type(e).__name__}")
    for w in warned:
        assert_hidden(str(w.message), "a warning")
    logged = all_logged(debug_logs)
    assert "password=xxx" in logged, "SQLAlchemy's pool log (psycopg2's dsn, masked) was not captured"
    assert_hidden(logged, "the logs")
    out, err = capfd.readouterr()
    assert_hidden(out + err, "the process output")


def unreachable_urls(db_url: str) -> list[tuple[str, str]]:
    return [
        (with_password(db_url, port=1), "connection refused (no server on the port)"),
        (with_password(db_url, database="wq_sql_no_such_database"), "no such database"),
        (with_password(db_url, username="wq_sql_no_such_role"), "no such role"),
    ]


@pytest.mark.parametrize("backend", ["postgresql"])
def test_connection_errors_never_show_the_password(db_url: str, debug_logs: pytest.LogCaptureFixture,
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    for url, why in unreachable_urls(db_url):
        calls: list[Callable[[str], Any]] = [
            lambda u: WorkQueue(["a"], url=u, worker="w", busy_timeout=0.5), wq_sql.list_queues,
            wq_sql.upgrade, lambda u: wq_sql.drop_queue("q", u)]
        for call in calls:
            with pytest.raises(Exception) as info:  # noqa: B017 - any error; what matters is its text
                call(url)
            assert_hidden(error_texts(info.value), f"the error for {why}")
    assert_hidden(all_logged(debug_logs), "the logs")
    out, err = capfd.readouterr()
    assert_hidden(out + err, "the process output")


# ---------------------------------------------------------------- passwords, in the CLI


def wq_env(env: dict[str, str] | None = None) -> dict[str, str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WQ_SQL_")}
    full_env.update({"PYTHONPATH": str(ROOT), **(env or {})})
    return full_env


Command = tuple[list[str], dict[str, str]]  # argv of python -m wq_sql, extra environment


def run_side_by_side(batch: list[Command], cwd: Path) -> list[tuple[list[str], int, str, str]]:
    """Run independent ``python -m wq_sql`` commands at once: (argv, exit code, stdout, stderr)."""
    procs = [subprocess.Popen([sys.executable, "-m", "wq_sql", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=wq_env(env), cwd=cwd)
             for argv, env in batch]
    outputs = [p.communicate(timeout=120) for p in procs]
    return [(argv, p.returncode, out, err) for (argv, _), p, (out, err) in zip(batch, procs, outputs)]


@pytest.mark.parametrize("backend", ["postgresql"])
def test_cli_never_shows_the_password(db_url: str, tmp_path: Path) -> None:
    url = with_password(db_url)
    report = tmp_path / "r.html"
    ok: list[list[Command]] = [
        [(["upgrade", "--url", url], {})],
        [(["create", "train", "--works", "a", "b", "--epochs", "2", "--url", url], {})],
        [(["status", "train", "--url", url], {}), (["audit", "train", "--format", "json", "--url", url], {}),
         (["report", "train", "--out", str(report), "--url", url], {}), (["ls"], {"WQ_SQL_URL": url})],
        [(["requeue", "train", "--failed", "--url", url], {})],
        [(["reset", "train", "--yes", "--url", url], {})],
        [(["drop", "train", "--yes", "--url", url], {})],
    ]
    for batch in ok:
        for argv, code, out, err in run_side_by_side(batch, tmp_path):
            assert code == 0, (argv, out, err)
            assert_hidden(out + err, f"the output of wq-sql {argv[0]}")
    assert_hidden(report.read_text(), "the HTML report")

    refused, nodb, norole = (u for u, _ in unreachable_urls(db_url))
    failing: list[Command] = [
        (["status", "nope", "--url", url], {}), (["status", "nope", "--debug", "--url", url], {}),
        (["ls", "--url", refused], {}), (["ls"], {"WQ_SQL_URL": refused}), (["ls", "--url", nodb], {}),
        (["ls", "--debug", "--url", nodb], {}), (["ls", "--url", norole], {}),
    ]
    for argv, code, out, err in run_side_by_side(failing, tmp_path):
        assert code != 0, (argv, out, err)
        assert_hidden(out + err, f"the output of wq-sql {' '.join(argv[:2])}")
        if "--debug" not in argv:  # one line that shows where, with the password masked
            assert "Traceback" not in err and "***" in err, err
        else:
            assert "Traceback" in err, err


@pytest.mark.parametrize("backend", ["postgresql"])
def test_cli_error_lines_hide_short_and_quoted_passwords(db_url: str, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The last line of defence (``cli._scrub``) hides the password where a URL or a DSN gives it,
    by their structure only, so a one-letter password does not garble the rest of the message."""
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "10")
    short = make_url(db_url).set(password="x", database="wq_sql_no_such_database").render_as_string(
        hide_password=False)
    assert wq_cli.main(["ls", "--url", short]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "fix the database name" in err and ":***@" in err, err
    assert ":x@" not in err
    quoted = make_url(with_password(db_url)).render_as_string(hide_password=False).split(":")[2].split("@")[0]
    for leaked in (f"password={PASSWORD}", f"dsn 'user=u password={PASSWORD!r}'",
                   f"postgresql://u:{quoted}@h/db"):
        assert_hidden(wq_cli._scrub(f"error: {leaked} end"), "a scrubbed line")


# ---------------------------------------------------------------- bound parameters only

MARK = "Z7mark"
QNAME = f"q{MARK}'; DROP TABLE wq_items; --"
WORKER = f'w{MARK}"); --'
WORKS = [f"k{MARK}-{i}'); DELETE FROM wq_queues; --" for i in range(4)]
PREFIX = f"p{MARK}/"
ERROR = f"e{MARK}'); --"


class StatementLog:
    """Every statement wq_sql sends: SQLAlchemy's ``before_cursor_execute`` on every engine (its
    text has placeholders), and on SQLite also the driver's cursor (the claim path runs its
    own SQL on the raw ``sqlite3`` cursor, which SQLAlchemy's events do not see). The Postgres
    driver is not watched: psycopg2 inlines escaped values client-side by design."""

    def __init__(self) -> None:
        self.statements: list[str] = []
        self.parameters: list[str] = []
        self.raw: list[str] = []
        log = self

        class Cursor(sqlite3.Cursor):
            def execute(self, sql: str, parameters: Any = (), /) -> Any:
                log.raw.append(sql)
                return super().execute(sql, parameters)

            def executemany(self, sql: str, seq: Any, /) -> Any:
                log.raw.append(sql)
                return super().executemany(sql, seq)

        class Connection(sqlite3.Connection):
            def cursor(self, factory: Any = Cursor) -> Any:
                return super().cursor(factory)

        self._connection_class = Connection

    def before_cursor_execute(self, conn: Any, cursor: Any, statement: str, parameters: Any,
                              context: Any, executemany: bool) -> None:
        self.statements.append(statement)
        self.parameters.append(repr(parameters))

    def do_connect(self, dialect: Any, conn_rec: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        if dialect.name == "sqlite":
            cparams["factory"] = self._connection_class

    def __enter__(self) -> StatementLog:
        event.listen(Engine, "before_cursor_execute", self.before_cursor_execute)
        event.listen(Engine, "do_connect", self.do_connect)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(Engine, "before_cursor_execute", self.before_cursor_execute)
        event.remove(Engine, "do_connect", self.do_connect)

    def leaks(self) -> list[str]:
        return [s for s in self.statements + self.raw if MARK in s]


def test_names_and_works_reach_sql_only_as_bound_parameters(db_url: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "10")
    wq_sql.upgrade(db_url)
    with StatementLog() as log:
        engine = make_engine(resolve_url(db_url))
        try:
            wq = WorkQueue(WORKS, num_epochs=2, prefix=PREFIX, name=QNAME, worker=WORKER, engine=engine,
                           lease_ahead=2, max_attempts=2, auto_complete=False, lease_seconds=2,
                           heartbeat_seconds=0.2)
            a = wq.take()
            wq.complete(a)
            wq.release(wq.take())
            wq.fail(wq.take(), ERROR)
            for item in wq.take_many(2):
                wq.complete(item)
            wq.prefetch()
            time.sleep(0.5)  # heartbeats: lease renewal and expiry run
            wq.progress()
            wq.extend_epochs(3)
            with WorkQueue.attach(QNAME, url=db_url, worker=WORKER + "-2") as other:
                other.take()
            with pytest.raises(QueueConfigMismatch):
                WorkQueue(WORKS[:1], name=QNAME, url=db_url, worker=WORKER + "-3")
            wq.close()
        finally:
            engine.dispose()
        wq_sql.list_queues(db_url)
        create_queue(WORKS, name=QNAME + "-c", prefix=PREFIX, url=db_url)
        wq_sql.compact_queue(QNAME, db_url)
        capsys.readouterr()
        for argv in (["ls"], ["status", QNAME], ["audit", QNAME, "--format", "json"],
                     ["requeue", QNAME, "--worker", WORKER], ["requeue", QNAME, "--failed"],
                     ["report", QNAME, "--out", str(tmp_path / "r.html")],
                     ["create", QNAME + "-cli", "--works", *WORKS, "--prefix", PREFIX],
                     ["reset", QNAME, "--yes"], ["drop", QNAME + "-cli", "--yes"]):
            assert wq_cli.main([*argv, "--url", db_url]) == 0, capsys.readouterr().err
        wq_sql.reset_queue(QNAME + "-c", db_url)
        assert wq_sql.drop_queue(QNAME, db_url) and wq_sql.drop_queue(QNAME + "-c", db_url)
    # The logs saw the traffic: the marked text went to the database, as parameters.
    params = "\n".join(log.parameters)
    for text in (QNAME, WORKER, WORKS[0], ERROR):
        assert repr(text)[1:-1] in params or text in params, f"{text!r} never seen in the parameters"
    if engine.dialect.name == "sqlite":
        assert any("MATERIALIZED" in s for s in log.raw), "the driver-level claim was not seen"
    assert not log.leaks(), "user text in statement text:\n" + "\n---\n".join(log.leaks()[:5])
