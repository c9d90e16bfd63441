"""The ``wq-sql`` command (also ``python -m wq_sql``): the schema and whole queues, for operators.

::

    wq-sql upgrade [--sql]      create or upgrade the schema (--sql: print the DDL for a DBA)
    wq-sql current              the schema revision of the database
    wq-sql ls                   queues, their configuration and progress
    wq-sql status NAME          one queue: items per epoch and state, live workers
    wq-sql reset NAME --yes     start a queue over at epoch 0 (its history is deleted)
    wq-sql drop NAME --yes      delete a queue and everything it holds

Every command takes ``--url`` (default ``$WQ_SQL_URL``, else ``sqlite:///wq_sql.db``) and
``--schema``. An error prints one line that names the fix and exits 1 (``--debug``: the
traceback). Passwords never appear in the output.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

from alembic import command
from alembic.util import CommandError
from sqlalchemy import Connection, Engine, func, select
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from wq_sql import admin, migrate, ops
from wq_sql.engine import Backend, make_engine, resolve_url, safe_url
from wq_sql.errors import QueueNotFound, SchemaOutdated, WqSqlError
from wq_sql.states import CLAIMED

PROG = "wq-sql"
# Operators' commands should fail fast on an unreachable host; libpq reads this variable.
PG_CONNECT_TIMEOUT = "10"
# status collapses finished epochs into one line beyond this many epoch rows.
MAX_EPOCH_ROWS = 12


class CliError(Exception):
    """An error whose message is the one line the user sees."""


# ---------------------------------------------------------------- helpers


def _url(args: argparse.Namespace) -> URL:
    return resolve_url(args.url)


def _where(url: URL, schema: Optional[str]) -> str:
    """The ``--url``/``--schema`` arguments that name this database in a suggested command."""
    return f"--url '{safe_url(url)}'" + (f" --schema {schema}" if schema else "")


def _label(url: URL, schema: Optional[str]) -> str:
    """The database as it appears in messages (no password)."""
    return safe_url(url) + (f" (schema {schema})" if schema else "")


def _engine(args: argparse.Namespace, *, must_exist: bool) -> tuple[Engine, Optional[str]]:
    """An engine on ``--url``, connected once to read the schema revision.

    ``must_exist``: a SQLite file that is not there is an error (a typo in the path must not
    create an empty database)."""
    url = _url(args)
    if must_exist and url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        path = Path(url.database).expanduser()
        if path.parent.is_dir() and not path.exists():
            raise CliError(f"there is no SQLite file {str(path.resolve())!r}; check --url, or create it "
                           f"with: python -m wq_sql upgrade {_where(url, args.schema)}")
    engine = make_engine(url, schema=args.schema, pool_size=1)
    try:
        with engine.connect().execution_options(wq_read=True) as conn:
            rev = migrate.current_revision(conn, args.schema)
            conn.rollback()
    except DBAPIError as e:
        engine.dispose()
        raise CliError(_connect_error(url, e)) from e
    return engine, rev


def _connect_error(url: URL, e: DBAPIError) -> str:
    detail = _first_line(e.orig)
    low = detail.lower()
    where = safe_url(url)
    if url.get_backend_name() == "sqlite":
        return (f"cannot open the SQLite database {where}: {detail}; check the path and its "
                "permissions in --url (or $WQ_SQL_URL)")
    if "password authentication failed" in low or "no password supplied" in low:
        fix = "check the user and password in --url (or $WQ_SQL_URL, or ~/.pgpass)"
    elif "database" in low and "does not exist" in low:
        fix = f"create the database (createdb {url.database}) or fix the database name in --url"
    elif "role" in low and "does not exist" in low:
        fix = "fix the user name in --url"
    else:
        fix = "check the host and port in --url (or $WQ_SQL_URL) and that the server is running"
    return f"cannot connect to {where}: {detail}; {fix}"


def _first_line(obj: object) -> str:
    lines = [ln.strip() for ln in str(obj).splitlines() if ln.strip()]
    return lines[0] if lines else type(obj).__name__


def _require_head(url: URL, schema: Optional[str], rev: Optional[str]) -> None:
    head = migrate.head_revision()
    if rev is None:
        raise CliError(f"{_label(url, schema)} has no wq_sql tables; "
                       f"create them with: python -m wq_sql upgrade {_where(url, schema)}")
    if rev != head:
        raise SchemaOutdated(
            f"the database is at schema revision {rev!r}, this wq_sql needs {head!r}. Upgrade it with: "
            f"python -m wq_sql upgrade {_where(url, schema)}. If the database is newer, upgrade wq_sql.")


def _find_queue(conn: Connection, url: URL, name: str) -> Any:
    row = ops.find_queue(conn, name)
    if row is None:
        raise QueueNotFound(f"no queue named {name!r} in {safe_url(url)}; `python -m wq_sql ls` lists "
                            "the queues")
    return row


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[bool]) -> list[str]:
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for r in cells:
        parts = [c.rjust(w) if right[i] else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(parts).rstrip())
    return out


def _confirm(args: argparse.Namespace, what: str) -> None:
    if args.yes:
        return
    if sys.stdin.isatty():
        answer = input(f"{what}? [y/N] ").strip().lower()
        if answer in ("y", "yes"):
            return
        raise CliError("cancelled; nothing changed")
    raise CliError(f"refusing to {what} without confirmation; add --yes")


def _db_now(conn: Connection, b: Backend) -> dt.datetime:
    now = conn.execute(select(b.now())).scalar_one()
    if isinstance(now, str):  # SQLite's text clock
        now = dt.datetime.fromisoformat(now)
    if now.tzinfo is None:
        now = now.replace(tzinfo=dt.timezone.utc)
    return now


def _ago(now: dt.datetime, then: dt.datetime) -> str:
    s = max(0.0, (now - then).total_seconds())
    if s < 120:
        return f"{s:.1f}s ago"
    if s < 7200:
        return f"{s / 60:.0f}m ago"
    return f"{s / 3600:.1f}h ago"


# ---------------------------------------------------------------- commands


def cmd_upgrade(args: argparse.Namespace) -> int:
    url = _url(args)
    if args.sql:
        if args.schema and url.get_backend_name() == "postgresql":
            # Offline DDL names its tables unqualified; the schema comes from the search path.
            print(f'CREATE SCHEMA IF NOT EXISTS "{args.schema}";\nSET search_path TO "{args.schema}";\n')
        cfg = migrate.alembic_config(url=url.render_as_string(hide_password=True), schema=args.schema)
        command.upgrade(cfg, "head", sql=True)
        return 0
    engine, before = _engine(args, must_exist=False)
    engine.dispose()
    after = admin.upgrade(url, args.schema)
    where = _label(url, args.schema)
    if before == after:
        print(f"{where} is at revision {after} (head); nothing to do")
    else:
        print(f"{where} upgraded from {before or 'an empty database'} to revision {after} (head)")
    return 0


def cmd_current(args: argparse.Namespace) -> int:
    url = _url(args)
    engine, rev = _engine(args, must_exist=True)
    engine.dispose()
    head = migrate.head_revision()
    where = _label(url, args.schema)
    if rev is None:
        print(f"{where}: no wq_sql schema; create it with: python -m wq_sql upgrade "
              f"{_where(url, args.schema)}")
    elif rev == head:
        print(f"{where}: revision {rev} (head)")
    else:
        print(f"{where}: revision {rev}; this wq_sql needs {head}: run python -m wq_sql upgrade "
              f"{_where(url, args.schema)}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    url = _url(args)
    engine, rev = _engine(args, must_exist=True)
    engine.dispose()
    _require_head(url, args.schema, rev)
    queues = admin.list_queues(url, args.schema)
    if not queues:
        print(f"no queues in {_label(url, args.schema)}")
        return 0
    rows = []
    for q in queues:
        finished = q["done"] + q["failed"]
        pct = 100.0 * finished / q["total"] if q["total"] else 100.0
        rows.append([q["name"], q["items_per_epoch"], f"{q['epochs_created']}/{q['num_epochs']}",
                     "yes" if q["shuffle"] else "no", q["seed"], q["num_slices"], q["prefix"],
                     q["done"], q["failed"], q["total"], f"{pct:.1f}%"])
    headers = ["QUEUE", "ITEMS/EPOCH", "EPOCHS", "SHUFFLE", "SEED", "SLICES", "PREFIX",
               "DONE", "FAILED", "TOTAL", "PROGRESS"]
    right = [False, True, True, False, True, True, False, True, True, True, True]
    print("\n".join(_table(headers, rows, right)))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    url = _url(args)
    engine, rev = _engine(args, must_exist=True)
    try:
        _require_head(url, args.schema, rev)
        conn_opts: dict[str, Any] = {"wq_read": True}
        if engine.dialect.name == "postgresql":
            conn_opts["isolation_level"] = "REPEATABLE READ"  # one snapshot for every count below
        with engine.connect().execution_options(**conn_opts) as conn, conn.begin():
            lines = _status(conn, Backend(engine.dialect.name), url, args.schema, args.name)
    finally:
        engine.dispose()
    print("\n".join(lines))
    return 0


def _status(conn: Connection, b: Backend, url: URL, schema: Optional[str], name: str) -> list[str]:
    q = _find_queue(conn, url, name)
    t, i, w = ops.tallies, ops.items, ops.workers
    # done and failed come from the counters; claimed rows are few and indexed (partial index).
    per_epoch = {r.epoch: (int(r.done), int(r.failed)) for r in conn.execute(
        select(t.c.epoch, func.sum(t.c.n_done).label("done"), func.sum(t.c.n_failed).label("failed"))
        .where(t.c.queue_id == q.id).group_by(t.c.epoch))}
    claimed_rows = conn.execute(
        select(i.c.epoch, i.c.worker_id, func.count().label("n"))
        .where(i.c.queue_id == q.id, i.c.state == CLAIMED).group_by(i.c.epoch, i.c.worker_id)).all()
    claimed: dict[int, int] = {}
    holding: dict[Optional[int], int] = {}
    for r in claimed_rows:
        claimed[r.epoch] = claimed.get(r.epoch, 0) + r.n
        holding[r.worker_id] = holding.get(r.worker_id, 0) + r.n
    by_worker = {r.worker_id: (int(r.done), int(r.failed)) for r in conn.execute(
        select(t.c.worker_id, func.sum(t.c.n_done).label("done"), func.sum(t.c.n_failed).label("failed"))
        .where(t.c.queue_id == q.id).group_by(t.c.worker_id))}
    workers = conn.execute(select(w).where(w.c.queue_id == q.id).order_by(w.c.name)).all()
    now = _db_now(conn, b)

    n = q.n_works
    out = [f"queue {q.name!r} in {_label(url, schema)}",
           f"{n} items per epoch, {q.num_epochs} epoch(s), "
           + (f"shuffled (seed {q.seed})" if q.shuffle else "in order")
           + (f", prefix {q.prefix!r}" if q.prefix else "")
           + (f", {q.num_slices} slices" if q.num_slices else "")
           + f", max {q.max_attempts} attempts", ""]

    rows: list[list[object]] = []
    totals = [0, 0, 0, 0]
    epochs = list(range(q.epochs_created))
    finished_prefix = 0
    if len(epochs) > MAX_EPOCH_ROWS:
        # Collapse the leading finished epochs of a long job into one row.
        while (finished_prefix < len(epochs) - MAX_EPOCH_ROWS // 2
               and sum(per_epoch.get(finished_prefix, (0, 0))) >= n
               and not claimed.get(finished_prefix)):
            finished_prefix += 1
        if finished_prefix > 1:
            d = sum(per_epoch.get(e, (0, 0))[0] for e in range(finished_prefix))
            f = sum(per_epoch.get(e, (0, 0))[1] for e in range(finished_prefix))
            rows.append([f"0-{finished_prefix - 1}", 0, 0, d, f])
            totals[2] += d
            totals[3] += f
            epochs = epochs[finished_prefix:]
    for e in epochs:
        d, f = per_epoch.get(e, (0, 0))
        c = claimed.get(e, 0)
        p = n - d - f - c
        rows.append([e, p, c, d, f])
        for k, v in enumerate((p, c, d, f)):
            totals[k] += v
    later = q.num_epochs - q.epochs_created
    if later > 0:
        label = str(q.epochs_created) if later == 1 else f"{q.epochs_created}-{q.num_epochs - 1}"
        rows.append([f"{label} (not created yet)", n * later, 0, 0, 0])
        totals[0] += n * later
    rows.append(["total", *totals])
    out += _table(["EPOCH", "PENDING", "CLAIMED", "DONE", "FAILED"], rows, [False, True, True, True, True])
    total = n * q.num_epochs
    pct = 100.0 * (totals[2] + totals[3]) / total if total else 100.0
    state = "finished" if totals[2] + totals[3] >= total else "in progress"
    out += [f"{state}: {totals[2] + totals[3]} of {total} items done or failed ({pct:.1f}%)", ""]

    live = [r for r in workers if r.heartbeat_at is not None]
    left = len(workers) - len(live)
    if live:
        out += _table(["WORKER", "HOST", "PID", "LAST HEARTBEAT", "HOLDING", "DONE", "FAILED"],
                      [[r.name, r.host, r.pid, _ago(now, r.heartbeat_at), holding.get(r.id, 0),
                        *by_worker.get(r.id, (0, 0))] for r in live],
                      [False, False, True, False, True, True, True])
    else:
        out.append("no live workers")
    if left:
        out.append(f"({left} {'more ' if live else ''}worker(s) closed cleanly)")
    orphans = sum(k for wid, k in holding.items() if wid not in {r.id for r in live})
    if orphans:
        out.append(f"{orphans} claimed item(s) belong to workers that are not heartbeating; they return "
                   "to the queue when their lease expires")
    return out


def cmd_reset(args: argparse.Namespace) -> int:
    url = _url(args)
    engine, rev = _engine(args, must_exist=True)
    try:
        _require_head(url, args.schema, rev)
        with engine.connect().execution_options(wq_read=True) as conn, conn.begin():
            q = _find_queue(conn, url, args.name)
            done, failed = ops.progress(conn, q.id)
            live = conn.execute(select(func.count()).select_from(ops.workers).where(
                ops.workers.c.queue_id == q.id, ops.workers.c.heartbeat_at.is_not(None))).scalar_one()
    finally:
        engine.dispose()
    _confirm(args, f"reset queue {args.name!r} ({done} done and {failed} failed items and its history "
                   "are deleted)")
    if live:
        print(f"warning: {live} worker(s) of {args.name!r} have not closed; stop them, their items are "
              "forgotten", file=sys.stderr)
    admin.reset_queue(args.name, url, args.schema)
    print(f"reset queue {args.name!r}: epoch 0 has {q.n_works} pending items "
          f"(deleted {done} done, {failed} failed and the history)")
    return 0


def cmd_drop(args: argparse.Namespace) -> int:
    url = _url(args)
    engine, rev = _engine(args, must_exist=True)
    try:
        _require_head(url, args.schema, rev)
        with engine.connect().execution_options(wq_read=True) as conn, conn.begin():
            _find_queue(conn, url, args.name)
    finally:
        engine.dispose()
    _confirm(args, f"drop queue {args.name!r} with its items and history")
    if not admin.drop_queue(args.name, url, args.schema):
        raise QueueNotFound(f"no queue named {args.name!r} in {safe_url(url)} (dropped meanwhile?)")
    print(f"dropped queue {args.name!r}")
    return 0


# ---------------------------------------------------------------- entry point


def _parser() -> argparse.ArgumentParser:
    # The common options work before and after the command; SUPPRESS keeps a subcommand's
    # parser from overwriting a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS,
                        help="database URL (default: $WQ_SQL_URL, else sqlite:///wq_sql.db)")
    common.add_argument("--schema", default=argparse.SUPPRESS,
                        help="PostgreSQL schema holding the wq_sql tables")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks")

    p = argparse.ArgumentParser(prog=PROG, parents=[common],
                                description="Operate wq_sql job tables: schema, queues, progress.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], help=help, description=help)
        sp.set_defaults(func=fn)
        return sp

    up = add("upgrade", cmd_upgrade, "create or upgrade the wq_sql schema")
    up.add_argument("--sql", action="store_true", help="print the DDL instead of running it (offline)")
    add("current", cmd_current, "show the schema revision of the database")
    add("ls", cmd_ls, "list queues with their configuration and progress")
    st = add("status", cmd_status, "items per epoch and state, and the live workers of a queue")
    st.add_argument("name", metavar="NAME")
    rs = add("reset", cmd_reset, "start a queue over at epoch 0 (deletes its progress and history)")
    rs.add_argument("name", metavar="NAME")
    rs.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    dr = add("drop", cmd_drop, "delete a queue with its items and history")
    dr.add_argument("name", metavar="NAME")
    dr.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    return p


def _scrub(text: str, args: argparse.Namespace) -> str:
    """Belt and braces: no error text may carry the password of ``--url``."""
    try:
        password = resolve_url(args.url).password
    except WqSqlError:
        password = None
    if password:
        text = text.replace(str(password), "***")
    return " ".join(text.split())  # one line


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``wq-sql`` command; returns the exit code."""
    args = _parser().parse_args(argv)
    for name, default in (("url", None), ("schema", None), ("debug", False)):
        if not hasattr(args, name):
            setattr(args, name, default)
    os.environ.setdefault("PGCONNECT_TIMEOUT", PG_CONNECT_TIMEOUT)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `wq-sql upgrade --sql | head`
        sys.stderr.close()
        return 0
    except Exception as e:
        if args.debug:
            raise
        print(f"{PROG}: error: {_scrub(_describe(e), args)}", file=sys.stderr)
        return 1


def _describe(e: Exception) -> str:
    if isinstance(e, (CliError, WqSqlError)):
        return str(e)
    if isinstance(e, CommandError):
        return (f"{e}; the database may have been migrated by a newer wq_sql: upgrade wq_sql "
                "(or run with --debug)")
    if isinstance(e, DBAPIError):
        return f"database error: {_first_line(e.orig)} (run with --debug for details)"
    if isinstance(e, SQLAlchemyError):
        return f"{type(e).__name__}: {_first_line(e)} (run with --debug for details)"
    return f"unexpected {type(e).__name__}: {_first_line(e)} (run with --debug for the traceback)"
