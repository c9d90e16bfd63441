"""The ``wq-sql`` command (also ``python -m wq_sql``): the schema and whole queues, for operators.

::

    wq-sql upgrade [--sql [--from REV]]
                                create or upgrade the schema; alias migrate. --sql prints the DDL
                                from the database's revision (or REV, offline) to head for a DBA
    wq-sql current              the schema revision of the database
    wq-sql create NAME (--works WORK|GLOB... | --works-from FILE) [--epochs N] [--shuffle/--no-shuffle]
                  [--seed S] [--prefix P] [--num-slices K] [--max-attempts M]
                                create a queue ahead of the job (WorkQueue's rules and mismatch errors)
    wq-sql extend NAME --epochs N
                                raise a queue's num_epochs (never lowers it)
    wq-sql ls                   queues, their configuration and progress
    wq-sql mix NAME [--set WEIGHTS]
                                a weighted queue's weights, their changes, the realized shares;
                                --set changes the weights of the running queue
    wq-sql quarantine NAME [(--work PATTERN | --where PREDICATE) --reason TEXT]
                                hold works back from every worker until unquarantined (no
                                argument: list the works in quarantine)
    wq-sql unquarantine NAME (--work PATTERN | --where PREDICATE | --all)
                                give quarantined works back to the queue
    wq-sql status NAME [--watch [--interval S]]
                                one queue: items per epoch and state, live workers, throughput, ETA
    wq-sql audit NAME [--format table|csv|json]
                                who consumed what, re-deliveries, failures; exit 2 unless every done
                                item was done exactly once
    wq-sql trace NAME (--step N [--to M] | --checkpoint S | --work WORK) [--worker W] [--run R]
                                lineage: the items and record ranges of a training step's batch,
                                of what a checkpoint covered, or of every step on a work
    wq-sql requeue NAME (--failed | --expired | --worker W | --done) [--epoch E]
                                put items back to pending, in one transaction
    wq-sql report NAME --out FILE.html|FILE.svg|FILE.png
                                a timeline: one lane per worker, one bar per delivery
    wq-sql metrics [--port 9464] [--host 127.0.0.1] [--queue NAME]... [--per-worker | --top-k K]
                                serve Prometheus metrics computed from the database at each scrape
    wq-sql dashboard [--port 8464] [--host 127.0.0.1] [--queue NAME] [--minutes N]
                                serve a live web page: progress, ETA, stragglers, failures, timeline
    wq-sql reset NAME --yes     start a queue over at epoch 0 (its history is deleted)
    wq-sql drop NAME --yes      delete a queue and everything it holds

``--works`` takes works as arguments: one with ``* ? [`` is a glob of local files, expanded in
sorted order (``sorted(glob.glob(p))`` in a worker gives the same list); anything else is one work
as given (``hdfs://...``, a table name). ``--works-from FILE`` reads one work per line instead.
Works are stored as given: a relative path is opened relative to each worker's own working
directory, and ``create`` prints a note when there are any.

Every command takes ``--url`` (default ``$WQ_SQL_URL``, else ``sqlite:///wq_sql.db``) and
``--schema``. An error prints one line that names the fix and exits 1 (``--debug``: the
traceback); ``audit`` exits 2 when its exactly-once check fails. Passwords never appear in the
output. Tables cut works, errors and prefixes to 80 characters (``audit --format json|csv`` keeps
them whole).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import glob
import json
import math
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from alembic import command
from alembic.util import CommandError
from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from wq_sql import admin
from wq_sql.errors import DatabaseUnavailable, QueueNotFound, SchemaOutdated, WqSqlError
from wq_sql.monitor import report
from wq_sql.plan import parse_weights
from wq_sql.sources import source_for
from wq_sql.states import CLAIMED, DONE, FAILED
from wq_sql.store import migrate, notify, statements
from wq_sql.store import mixing as mixing_store
from wq_sql.store.dialects import Dialect, dialect_of, sqlite_file
from wq_sql.store.engine import first_line as _first_line
from wq_sql.store.engine import make_engine, opening, resolve_url
from wq_sql.store.redact import mask_secrets, safe_url

T = TypeVar("T")
PROG = "wq-sql"
# Operators' commands should fail fast on an unreachable host; libpq reads this variable.
PG_CONNECT_TIMEOUT = "10"
# wq-sql audit exits with this when the exactly-once check fails (1: the command itself failed).
AUDIT_FAILED = 2
# status collapses finished epochs into one line beyond this many epoch rows.
MAX_EPOCH_ROWS = 12
# Human tables show works, errors and prefixes cut to this many characters (ELLIPSIS marks a cut).
CELL_CHARS = 80
ELLIPSIS = "..."
# num_epochs is at most 2**62 (wq_sql.plan.check_num_epochs).
MAX_EPOCHS = 2**62
MAX_ETA_SECONDS = 100 * 365 * 86400
# Where the fix in an error line says the URL comes from.
URL_GIVEN = "--url (or $WQ_SQL_URL)"


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
    path = sqlite_file(url)
    if must_exist and path is not None:
        if path.parent.is_dir() and not path.exists():
            raise CliError(f"there is no SQLite file {str(path.resolve())!r}; check --url, or create it "
                           f"with: python -m wq_sql upgrade {_where(url, args.schema)}")
    engine = make_engine(url, schema=args.schema, pool_size=1)
    try:
        with opening(url, given=URL_GIVEN), engine.connect().execution_options(wq_read=True) as conn:
            rev = migrate.current_revision(conn, args.schema)
            conn.rollback()
    except BaseException:
        engine.dispose()
        raise
    return engine, rev


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
    row = statements.find_queue(conn, name)
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


class _Cut:
    """Cuts works, errors and prefixes to one line of at most ``CELL_CHARS`` characters for human
    output (a 1 MB work must not print 1 MB), and remembers whether it cut anything, so that the
    output can say where the full values are."""

    def __init__(self) -> None:
        self.cut = False

    def __call__(self, text: Optional[str], *, first_line: bool = False) -> Optional[str]:
        if text is None:
            return None
        shown = text
        if first_line:  # an error: its first line (a traceback's others are in the full value)
            shown = _first_line(text)
            self.cut = self.cut or shown != text.strip()
        shown = shown.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")
        if len(shown) > CELL_CHARS:
            shown = shown[:CELL_CHARS - len(ELLIPSIS)] + ELLIPSIS
            self.cut = True
        return shown

    def note(self, where: str) -> list[str]:
        """The line that says where the full values are, if anything was cut."""
        if not self.cut:
            return []
        return [f"(values cut to {CELL_CHARS} characters end with {ELLIPSIS}; {where} shows them in full)"]


def _confirm(args: argparse.Namespace, what: str) -> None:
    if args.yes:
        return
    if sys.stdin.isatty():
        answer = input(f"{what}? [y/N] ").strip().lower()
        if answer in ("y", "yes"):
            return
        raise CliError("cancelled; nothing changed")
    raise CliError(f"refusing to {what} without confirmation; add --yes")


def _db_now(conn: Connection, b: Dialect) -> dt.datetime:
    return b.db_now(conn)


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
        return _upgrade_sql(args, url)
    if args.from_rev is not None:
        raise CliError("--from REV goes with --sql (it says which revision the printed DDL starts from); "
                       "without --sql, upgrade reads the revision from the database")
    engine, before = _engine(args, must_exist=False)
    engine.dispose()
    after = admin.upgrade(url, args.schema)
    where = _label(url, args.schema)
    if before == after:
        print(f"{where} is at revision {after} (head); nothing to do")
    else:
        print(f"{where} upgraded from {before or 'an empty database'} to revision {after} (head)")
    return 0


def _upgrade_sql(args: argparse.Namespace, url: URL) -> int:
    """Print the DDL that takes the database from its revision to head: read from the database,
    or from ``--from REV`` without connecting (``--from base``: a database without the schema)."""
    head = migrate.head_revision()
    if args.from_rev is not None:
        start = None if args.from_rev == "base" else _known_revision(args.from_rev)
        source = f"revision {args.from_rev} (from --from; the database was not read)"
    else:
        start = _revision_for_sql(args, url)
        source = (f"revision {start}, read from {_label(url, args.schema)}" if start
                  else f"no wq_sql schema yet in {_label(url, args.schema)}")
    if start == head:
        print(f"-- {source}: already at head ({head}), nothing to upgrade")
        return 0
    print(f"-- wq_sql schema upgrade from {source} to {head} (head)")
    dialect = dialect_of(url)
    for line in dialect.ddl_preamble(args.schema, new=start is None):
        print(line)
    cfg = migrate.alembic_config(url=url.render_as_string(hide_password=True), schema=args.schema)
    sys.stdout.flush()
    command.upgrade(cfg, f"{start}:head" if start else "head", sql=True)
    for line in dialect.ddl_postscript():
        print(line)
    return 0


def _known_revision(rev: str) -> str:
    known = migrate.revisions()
    if rev not in known:
        raise CliError(f"--from {rev!r} is not a wq_sql schema revision; this wq_sql knows "
                       f"{', '.join(['base', *known])} (`wq-sql current` shows a database's)")
    return rev


def _revision_for_sql(args: argparse.Namespace, url: URL) -> Optional[str]:
    """The database's revision, for ``upgrade --sql`` (a missing SQLite file is a new database,
    and is not created)."""
    path = sqlite_file(url)
    if path is not None and not path.exists():
        return None
    try:
        engine, rev = _engine(args, must_exist=False)
    except (CliError, DatabaseUnavailable) as e:
        raise CliError(f"{e}; or print the DDL without connecting: upgrade --sql --from REV (the "
                       "database's revision, `base` for one without the wq_sql schema)") from e
    engine.dispose()
    if rev is not None and rev not in migrate.revisions():
        raise SchemaOutdated(f"{_label(url, args.schema)} is at schema revision {rev!r}, which this wq_sql "
                             f"does not know (its newest is {migrate.head_revision()!r}); upgrade wq_sql")
    return rev


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
    cut = _Cut()
    for q in queues:
        finished = q["done"] + q["failed"] + q["quarantined"]
        pct = 100.0 * finished / q["total"] if q["total"] else 100.0
        rows.append([q["name"], q["items_per_epoch"], f"{q['epochs_created']}/{q['num_epochs']}",
                     "yes" if q["shuffle"] else "no", q["seed"], q["num_slices"], cut(q["prefix"]),
                     q["done"], q["failed"], q["total"], f"{pct:.1f}%"])
    headers = ["QUEUE", "ITEMS/EPOCH", "EPOCHS", "SHUFFLE", "SEED", "SLICES", "PREFIX",
               "DONE", "FAILED", "TOTAL", "PROGRESS"]
    right = [False, True, True, False, True, True, False, True, True, True, True]
    print("\n".join(_table(headers, rows, right) + cut.note("SELECT name, prefix FROM wq_queues")))
    return 0


@contextmanager
def _checked_engine(args: argparse.Namespace, url: URL) -> Iterator[Engine]:
    """An engine on an existing database at the head revision, disposed afterwards."""
    engine, rev = _engine(args, must_exist=True)
    try:
        _require_head(url, args.schema, rev)
        yield engine
    finally:
        engine.dispose()


def _snapshot(engine: Engine, fn: Callable[[Connection], T]) -> T:
    """Run ``fn`` in one read-only transaction that sees one snapshot (Postgres: REPEATABLE READ;
    SQLite: a read transaction in WAL mode is a snapshot already)."""
    conn_opts: dict[str, Any] = {"wq_read": True, **dialect_of(engine).snapshot_options}
    with engine.connect().execution_options(**conn_opts) as conn, conn.begin():
        return fn(conn)


def cmd_create(args: argparse.Namespace) -> int:
    url = _url(args)
    given: Any = _read_sources(args.source) if args.source else _read_works(args)
    if args.weights is not None and not args.source:
        raise CliError("--weights needs named sources: give them with --source NAME=WORK (repeatable)")
    works = [w for ws in given.values() for w in ws] if args.source else given
    engine, _ = _engine(args, must_exist=False)  # a clear line if the database is unreachable
    engine.dispose()
    created, q = admin.create_queue(
        given, num_epochs=args.epochs, shuffle=args.shuffle, seed=args.seed, prefix=args.prefix,
        num_slices=args.num_slices, name=args.name, url=url, max_attempts=args.max_attempts,
        schema=args.schema, weights=None if args.weights is None else parse_weights(args.weights))
    how = (f"shuffled with seed {q.seed} (workers may pass seed={q.seed} or seed=None)" if q.shuffle
           else "in order")
    if created:
        print(f"created queue {q.name!r} in {_label(url, args.schema)}: {q.n_works} items per epoch, "
              f"{q.num_epochs} epoch(s), {how}, max {q.max_attempts} attempts")
    else:
        print(f"queue {q.name!r} already exists with this configuration ({q.n_works} items per epoch, "
              f"{q.num_epochs} epoch(s), {how}); nothing to do")
        if args.weights is not None:
            print(f"note: the weights in force stay; change them with: {PROG} mix {q.name} --set WEIGHTS",
                  file=sys.stderr)
    relative = _relative_paths(works, args.prefix)
    if relative:
        example = _Cut()(repr(relative[0]))
        print(f"note: {len(relative)} of {len(works)} works are relative paths (e.g. {example}), "
              f"stored as given: each worker opens them relative to its own working directory, not "
              f"necessarily {os.getcwd()}; give absolute paths or --prefix if workers run elsewhere",
              file=sys.stderr)
    return 0


URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _relative_paths(works: Sequence[str], prefix: Optional[str]) -> list[str]:
    """The works a worker opens relative to its working directory: plain paths and ``lines:``
    files that are not absolute (after ``prefix``), and not URLs (``hdfs://...``)."""
    out = []
    for w in works:
        src = source_for(w)
        if src is None:
            path = (prefix or "") + w.strip()
            if URL_SCHEME.match(path):
                continue
        elif src.scheme == "lines":
            path = w.strip()[len("lines:"):]
        else:
            continue  # a table, or a source of its own: not a file path here
        if not os.path.isabs(path):
            out.append(w)
    return out


GLOB_CHARS = set("*?[")


def _read_works(args: argparse.Namespace) -> list[str]:
    """The works, in order: ``--works-from`` lines, else ``--works`` arguments with globs expanded
    (sorted, so that a worker computing ``sorted(glob.glob(...))`` gives the same list)."""
    if args.works_from is not None:
        src = args.works_from
        try:
            text = sys.stdin.read() if src == "-" else Path(src).read_text(encoding="utf-8")
        except OSError as e:
            raise CliError(f"cannot read --works-from {src!r}: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise CliError(f"--works-from {src!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
                           "save it as UTF-8, one work per line") from e
        works = [ln.strip() for ln in text.splitlines()]
        works = [w for w in works if w and not w.startswith("#")]
        if not works:
            raise CliError(f"--works-from {src!r} lists no works (one per line; # starts a comment)")
        return works
    return _expand(args.works, "--works")


def _expand(args: Sequence[str], option: str) -> list[str]:
    """Works as given, each argument with * ? [ a glob of local files, expanded in sorted order."""
    works = []
    for arg in args:
        if GLOB_CHARS & set(arg) and source_for(arg) is None:  # table:t?key=id is no glob
            found = sorted(glob.glob(arg, recursive=True))
            if not found:
                what = f"{option}{'' if option.endswith('=') else ' '}{arg!r}"
                raise CliError(f"{what} matches no file (relative to {os.getcwd()}); quote the pattern so "
                               "that the shell does not expand it")
            works += found
        else:
            works.append(arg)
    return works


def _read_sources(specs: Sequence[str]) -> dict[str, list[str]]:
    """``--source web=data/web/*.txt --source code=a.txt``: the works of each named source, in
    the order given (a source named twice gets the works of both, in order)."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, eq, work = spec.partition("=")
        if not eq or not name.strip() or not work.strip():
            raise CliError(f"--source {spec!r}: write NAME=WORK or NAME=GLOB, e.g. "
                           "--source 'web=data/web/*.txt'")
        out.setdefault(name.strip(), []).extend(_expand([work.strip()], f"--source {name.strip()}="))
    return out


def cmd_extend(args: argparse.Namespace) -> int:
    url = _url(args)
    with _checked_engine(args, url) as engine:
        _snapshot(engine, lambda conn: _find_queue(conn, url, args.name))
    before, after = admin.extend_queue(args.name, args.epochs, url, args.schema)
    if before == after:
        print(f"queue {args.name!r} has {after} epoch(s) already; nothing to do")
    else:
        print(f"queue {args.name!r}: num_epochs {before} -> {after}; workers now join with "
              f"num_epochs={after}")
    return 0


def cmd_mix(args: argparse.Namespace) -> int:
    url = _url(args)
    if args.set is not None:
        out = admin.set_mix(args.name, args.set, url, args.schema)
        shown = ", ".join(f"{k}={v:.4g}" for k, v in out.weights.items())
        if out.epoch is None:
            print(f"queue {args.name!r}: weights now {shown}; no undelivered item was waiting, so the "
                  "next epochs follow them")
        else:
            print(f"queue {args.name!r}: weights now {shown}; {out.redrawn} undelivered items redrawn "
                  f"from epoch {out.epoch} seq {out.seq} on; every worker follows from its next claim")
        return 0
    r = admin.mix_report(args.name, url, args.schema)
    print(f"queue {args.name!r}: weights in force")
    for s in r.sources:
        print(f"  {s.name:<16} {s.weight:8.4f}   ({s.n} items)")
    print("changes:")
    for c in r.changes:
        where = "" if c.id == r.changes[0].id else f" (from epoch {c.epoch} seq {c.seq}, {c.redrawn} redrawn)"
        print(f"  {c.at:%Y-%m-%d %H:%M:%S} by {c.by}: {c.weights}{where}")
    print("realized shares per epoch (delivered items; drawn: the epoch's plan as it stands):")
    print(f"  {'epoch':>5}  {'source':<16} {'drawn':>8} {'delivered':>9} {'share':>7}")
    per_epoch: dict[int, int] = {}
    for sh in r.shares:
        per_epoch[sh.epoch] = per_epoch.get(sh.epoch, 0) + sh.delivered
    for sh in r.shares:
        total = per_epoch[sh.epoch]
        share = f"{100.0 * sh.delivered / total:6.2f}%" if total else "      -"
        print(f"  {sh.epoch:>5}  {sh.source:<16} {sh.drawn:>8} {sh.delivered:>9} {share:>7}")
    return 0


def cmd_quarantine(args: argparse.Namespace) -> int:
    url = _url(args)
    if args.work is None and args.where is None:
        if args.reason is not None:
            raise CliError("--reason goes with --work PATTERN or --where PREDICATE (the works to quarantine)")
        held = admin.quarantined(args.name, url, args.schema)
        if not held:
            print(f"queue {args.name!r}: no work in quarantine")
            return 0
        print(f"queue {args.name!r}: {len(held)} work(s) in quarantine")
        cut = _Cut()
        print("\n".join(_table(["WORK", "ITEMS", "SINCE", "BY", "REASON"],
                               [[cut(h.work), h.items, f"{h.at:%Y-%m-%d %H:%M:%S}", cut(h.by), cut(h.reason)]
                                for h in held], [False, True, False, False, False])))
        return 0
    if args.reason is None:
        raise CliError("say why with --reason TEXT, e.g. --reason 'corrupt records (CRC errors)'")
    out = admin.quarantine(args.name, work=args.work, where=args.where, reason=args.reason, url=url,
                           schema=args.schema)
    again = f" ({out.already} more matched that were in already)" if out.already else ""
    print(f"queue {args.name!r}: {out.works} work(s) put in quarantine{again}; {out.items} item(s) "
          f"held back, {out.in_flight} of them taken back from workers; "
          f"wq-sql unquarantine {shlex.quote(args.name)} --all gives them back")
    return 0


def cmd_unquarantine(args: argparse.Namespace) -> int:
    works, n = admin.unquarantine(args.name, work=args.work, where=args.where, all=args.all, url=_url(args),
                                  schema=args.schema)
    print(f"queue {args.name!r}: {works} work(s) out of quarantine; {n} item(s) pending again")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    if not math.isfinite(args.interval) or args.interval <= 0:
        raise CliError(f"--interval must be a positive number of seconds, got {args.interval}")
    url = _url(args)
    with _checked_engine(args, url) as engine:
        b = dialect_of(engine)

        def frame() -> tuple[list[str], StatusSummary]:
            return _snapshot(engine, lambda conn: _status(conn, b, url, args.schema, args.name))

        if not args.watch:
            print("\n".join(frame()[0]))
            return 0
        return _watch(frame, args.interval)


@dataclass(frozen=True)
class StatusSummary:
    finished: int  # done + failed + quarantined
    total: int
    recent: int  # items done in the last minute
    rate: Optional[float]  # items done per second, recently (None: fewer than two recent)

    @property
    def complete(self) -> bool:
        return self.finished >= self.total


def _watch(frame: Callable[[], tuple[list[str], StatusSummary]], interval: float) -> int:
    """Redraw until the queue is finished. On a terminal the screen is cleared between frames;
    otherwise (a pipe, a log) frames are separated by a blank line."""
    tty = sys.stdout.isatty()
    cells = max(10, min(50, shutil.get_terminal_size((100, 24)).columns - 60)) if tty else 40
    while True:
        lines, summary = frame()
        bar = _progress_bar(summary, cells)
        text = "\n".join([bar, ""] + lines)
        if tty:
            sys.stdout.write("\033[H\033[2J" + text + "\n")
        else:
            sys.stdout.write(text + "\n\n")
        sys.stdout.flush()
        if summary.complete:
            return 0
        time.sleep(interval)


def _progress_bar(s: StatusSummary, cells: int) -> str:
    """``[#########.........]  45.2%  120/266  12.3 items/s (740 done in the last minute)  ETA 0:00:12``"""
    frac = s.finished / s.total if s.total else 1.0
    fill = int(frac * cells)  # full only when finished
    return ("[" + "#" * fill + "." * (cells - fill) + "]"
            + f" {100 * frac:5.1f}%  {s.finished}/{s.total}  " + _rate_eta(s))


def _rate_eta(s: StatusSummary) -> str:
    if s.complete:
        return "done"
    if s.recent == 0:
        return "no item done in the last minute  ETA -"
    if s.rate is None:
        return f"{s.recent} item done in the last minute (a rate needs two)  ETA -"
    rate = f"{s.rate:.1f} items/s ({s.recent} done in the last minute)"
    seconds = (s.total - s.finished) / s.rate
    if seconds > MAX_ETA_SECONDS:  # num_epochs may be up to 2**62; a timedelta overflows long before
        return f"{rate}  ETA more than 100 years"
    return f"{rate}  ETA {dt.timedelta(seconds=round(seconds))}"


def _status(conn: Connection, b: Dialect, url: URL, schema: Optional[str],
            name: str) -> tuple[list[str], StatusSummary]:
    q = _find_queue(conn, url, name)
    st = report.status(conn, b, q.id)
    per_epoch, claimed, holding, by_worker = st.per_epoch, st.claimed, st.holding, st.by_worker
    workers, now = st.workers, st.now

    n = q.n_works
    out = [f"queue {q.name!r} in {_label(url, schema)}",
           f"{n} items per epoch, {q.num_epochs} epoch(s), "
           + (f"shuffled (seed {q.seed})" if q.shuffle else "in order")
           + (f", prefix {_Cut()(repr(q.prefix))}" if q.prefix else "")
           + (f", {q.num_slices} slices" if q.num_slices else "")
           + f", max {q.max_attempts} attempts"]
    mix = mixing_store.load_sources(conn, q.id)
    if mix:
        out.append("weighted sources (wq-sql mix to see or change them): "
                   + ", ".join(f"{s.name}={s.weight:.4g}" for s in mix))
    out.append("")

    rows: list[list[object]] = []
    totals = [0, 0, 0, 0, 0]  # pending, claimed, done, failed, quarantined
    held_back = st.quarantined
    epochs = list(range(q.epochs_created))
    finished_prefix = 0
    if len(epochs) > MAX_EPOCH_ROWS:
        # Collapse the leading finished epochs of a long job into one row.
        while (finished_prefix < len(epochs) - MAX_EPOCH_ROWS // 2
               and sum(per_epoch.get(finished_prefix, (0, 0))) + held_back.get(finished_prefix, 0) >= n
               and not claimed.get(finished_prefix)):
            finished_prefix += 1
        if finished_prefix > 1:
            d = sum(per_epoch.get(e, (0, 0))[0] for e in range(finished_prefix))
            f = sum(per_epoch.get(e, (0, 0))[1] for e in range(finished_prefix))
            k = sum(held_back.get(e, 0) for e in range(finished_prefix))
            rows.append([f"0-{finished_prefix - 1}", 0, 0, d, f, k])
            totals[2] += d
            totals[3] += f
            totals[4] += k
            epochs = epochs[finished_prefix:]
    for e in epochs:
        d, f = per_epoch.get(e, (0, 0))
        c = claimed.get(e, 0)
        k = held_back.get(e, 0)
        p = n - d - f - c - k
        rows.append([e, p, c, d, f, k])
        for j, v in enumerate((p, c, d, f, k)):
            totals[j] += v
    later = q.num_epochs - q.epochs_created
    if later > 0:
        label = str(q.epochs_created) if later == 1 else f"{q.epochs_created}-{q.num_epochs - 1}"
        rows.append([f"{label} (not created yet)", n * later, 0, 0, 0, 0])
        totals[0] += n * later
    rows.append(["total", *totals])
    heads = ["EPOCH", "PENDING", "CLAIMED", "DONE", "FAILED", "QUARANTINED"]
    if not totals[4]:  # the column only for a queue with works in quarantine
        heads, rows = heads[:-1], [r[:-1] for r in rows]
    out += _table(heads, rows, [False] + [True] * (len(heads) - 1))
    total = n * q.num_epochs
    ended = totals[2] + totals[3] + totals[4]
    pct = 100.0 * ended / total if total else 100.0
    state = "finished" if ended >= total else "in progress"
    out.append(f"{state}: {ended} of {total} items done or failed"
               + (f" or in quarantine (wq-sql quarantine {shlex.quote(q.name)} lists the works)"
                  if totals[4] else "") + f" ({pct:.1f}%)")
    recent = st.recent
    summary = StatusSummary(ended, total, recent.done, recent.rate)
    if not summary.complete:
        out.append(f"throughput: {_rate_eta(summary)}")
    out.append("")

    live = [r for r in workers if r.heartbeat_at is not None]
    left = len(workers) - len(live)
    stale = [r for r in live if r.beat_seconds is not None
             and (now - r.heartbeat_at).total_seconds() > statements.STALE_BEATS * r.beat_seconds]
    if live:
        # DONE/MIN: the worker's items done in the last minute.
        out.append("workers (BUFFERED: claimed, not yet handed out, as of the last heartbeat; "
                   "HOLDING: handed out, not yet done)")
        out += _table(["WORKER", "HOST", "PID", "LAST HEARTBEAT", "BUFFERED", "HOLDING", "DONE", "FAILED",
                       "DONE/MIN"],
                      [[r.name, r.host, r.pid, _ago(now, r.heartbeat_at) + (" STALE" if r in stale else ""),
                        min(r.buffered or 0, holding.get(r.id, 0)),
                        max(0, holding.get(r.id, 0) - (r.buffered or 0)),
                        *by_worker.get(r.id, (0, 0)), recent.by_worker.get(r.id, 0)] for r in live],
                      [False, False, True, False, True, True, True, True, True])
    else:
        out.append("no live workers")
    if stale:
        names = ", ".join(repr(r.name) for r in stale)
        out.append(f"STALE: {names} stopped heartbeating ({statements.STALE_BEATS} heartbeat periods "
                   "missed); "
                   "a live worker of the queue returns their items within about one heartbeat period, "
                   "or now: "
                   f"wq-sql requeue {shlex.quote(q.name)} --worker {shlex.quote(stale[0].name)}")
    if left:
        out.append(f"({left} {'more ' if live else ''}worker(s) closed cleanly)")
    orphans = sum(k for wid, k in holding.items() if wid not in {r.id for r in live})
    if orphans:
        out.append(f"{orphans} claimed item(s) belong to workers that are not heartbeating; they return "
                   "to the queue when their lease expires")
    return out, summary


def cmd_audit(args: argparse.Namespace) -> int:
    url = _url(args)
    with _checked_engine(args, url) as engine:
        a = _snapshot(engine, lambda conn: report.audit(conn, _find_queue(conn, url, args.name)))
    if args.format == "json":
        print(json.dumps(a.as_dict(), indent=2))
    elif args.format == "csv":
        _audit_csv(a)
    else:
        print("\n".join(_audit_table(a)))
    if not a.ok:
        print(f"{PROG}: audit of {a.queue!r} FAILED the exactly-once check: "
              + "; ".join(_violation(v) for v in a.violations[:5])
              + (f" and {len(a.violations) - 5} more" if len(a.violations) > 5 else "")
              + ("; " if a.violations and a.counter_mismatches else "")
              + "; ".join(f"epoch {m['epoch']}: counters say {m['counted_done']} done, "
                          f"{m['counted_failed']} failed, rows say {m['rows_done']}, {m['rows_failed']}"
                          for m in a.counter_mismatches), file=sys.stderr)
        return AUDIT_FAILED
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    steps = None
    if args.step is not None:
        last = args.step if args.to is None else args.to
        if last < args.step:
            raise CliError(f"--to {args.to} comes before --step {args.step}: give the last step of the range")
        steps = range(args.step, last + 1)
    elif args.to is not None:
        raise CliError("--to goes with --step N (the first step of the range)")
    rows = admin.trace(args.name, steps=steps, checkpoint=args.checkpoint, work=args.work, worker=args.worker,
                       run=args.run, url=_url(args), schema=args.schema)
    if args.format == "json":
        print(json.dumps([{k: v for k, v in t._asdict().items() if k not in ("bounds", "handed")}
                          for t in rows], indent=2))
        return 0
    records = sum(t.last_record - t.first_record + 1 for t in rows)
    batches = len({(t.worker, t.run, t.step) for t in rows})
    print(f"queue {args.name!r}: {batches} step(s), {len(rows)} item range(s), {records} record(s)")
    cut = _Cut()
    print("\n".join(_table(["WORKER", "RUN", "STEP", "EPOCH", "SEQ", "RECORDS", "CHECKPOINT", "WORK"],
                           [[t.worker, t.run, t.step, t.epoch, t.seq, f"{t.first_record}..{t.last_record}",
                             t.checkpoint, cut(t.work)] for t in rows],
                           [False, True, True, True, True, True, True, False])))
    if cut.cut:
        print("(works cut to one line: --format json prints them whole)")
    return 0


def _violation(v: dict[str, Any]) -> str:
    what = f"epoch {v['epoch']} seq {v['seq']}" + (f" ({_Cut()(v['work'])})" if v["work"] is not None else "")
    state = f"is {v['state']}" if v["state"] else "has no item row"
    return f"{what} {state} with {v['done_events']} done event(s)"


def _audit_table(a: report.Audit) -> list[str]:
    cut = _Cut()
    out = [f"audit of queue {a.queue!r}: {a.items_per_epoch} items per epoch, "
           f"{a.epochs_created} of {a.num_epochs} epoch(s) created", "", "consumed per worker and epoch:"]
    if a.consumed:
        out += _table(["WORKER", "EPOCH", "DONE", "FAILED"],
                      [[c["worker"], c["epoch"], c["done"], c["failed"]] for c in a.consumed],
                      [False, True, True, True])
    else:
        out.append("  nothing consumed yet")
    out += ["", f"re-delivered items: {len(a.redeliveries)}"]
    if a.redeliveries:
        out += _table(["EPOCH", "SEQ", "WORK", "DELIVERIES", "HISTORY"],
                      [[r["epoch"], r["seq"], cut(r["work"]), r["deliveries"],
                        report.history_line(r["events"])] for r in a.redeliveries],
                      [True, True, False, True, False])
    out += ["", f"failed items: {len(a.failed)}"]
    if a.failed:
        out += _table(["EPOCH", "SEQ", "WORK", "WORKER", "ATTEMPTS", "LAST ERROR"],
                      [[f["epoch"], f["seq"], cut(f["work"]), f["worker"], f["attempts"],
                        cut(f["last_error"], first_line=True)] for f in a.failed],
                      [True, True, False, False, True, False])
    out.append("")
    if a.ok:
        out.append("exactly-once: OK, every done item has exactly one done event"
                   + (" and the counters agree with the rows" if a.epochs_created else ""))
    else:
        out.append(f"exactly-once: FAILED, {len(a.violations)} item(s) with a wrong number of done events, "
                   f"{len(a.counter_mismatches)} epoch(s) whose counters disagree with the rows")
        if a.violations:
            out += _table(["EPOCH", "SEQ", "WORK", "STATE", "DONE EVENTS"],
                          [[v["epoch"], v["seq"], cut(v["work"]), v["state"], v["done_events"]]
                           for v in a.violations], [True, True, False, False, True])
    if a.unchecked_epochs:
        out.append(f"(epochs {_ranges(a.unchecked_epochs)} were compacted: their done items are checked "
                   "only through the events kept)")
    return out + cut.note(f"python -m wq_sql audit {shlex.quote(a.queue)} --format json (or csv)")


def _ranges(nums: Sequence[int]) -> str:
    parts: list[str] = []
    for n in sorted(nums):
        if parts and parts[-1].split("-")[-1] == str(n - 1):
            parts[-1] = parts[-1].split("-")[0] + f"-{n}"
        else:
            parts.append(str(n))
    return ", ".join(parts)


AUDIT_CSV = ["section", "worker", "epoch", "seq", "work", "done", "failed", "deliveries", "history",
             "attempts", "last_error", "state", "done_events"]


def _audit_csv(a: report.Audit) -> None:
    """One long table: ``section`` says which part of the audit a row belongs to."""
    w = csv.DictWriter(sys.stdout, AUDIT_CSV, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for c in a.consumed:
        w.writerow({"section": "consumed", **c})
    for r in a.redeliveries:
        w.writerow({"section": "redelivered", **r, "worker": r["holders"][-1],
                    "history": report.history_line(r["events"])})
    for f in a.failed:
        w.writerow({"section": "failed", **f})
    for v in a.violations:
        w.writerow({"section": "violation", **v})
    w.writerow({"section": "exactly_once", "state": "ok" if a.ok else "failed"})


def cmd_requeue(args: argparse.Namespace) -> int:
    if args.epoch is not None and not 0 <= args.epoch < MAX_EPOCHS:
        raise CliError(f"--epoch must be an epoch number from 0 (the first) to 2**62 - 1, got {args.epoch}")
    url = _url(args)
    engine, rev = _engine(args, must_exist=True)
    b = dialect_of(engine)
    if args.failed:
        from_state, what = FAILED, "failed"
    elif args.done:
        from_state, what = DONE, "done"
    elif args.expired:
        from_state, what = CLAIMED, "claimed with an expired lease"
    else:
        from_state, what = CLAIMED, f"held by worker {args.worker!r}"
    warning, qid = None, None

    def run(conn: Connection) -> list[Any]:
        nonlocal warning, qid
        q = _find_queue(conn, url, args.name)
        qid = q.id
        wid = None
        if args.worker is not None:
            w = statements.find_worker(conn, q.id, args.worker, lock=False)
            if w is None:
                raise CliError(f"queue {args.name!r} has no worker named {args.worker!r}; "
                               f"`python -m wq_sql status {args.name}` lists them")
            wid = w.id
            if w.heartbeat_at is not None and (_db_now(conn, b) - w.heartbeat_at).total_seconds() < 30:
                warning = (f"warning: worker {args.worker!r} heartbeated "
                           f"{_ago(_db_now(conn, b), w.heartbeat_at)}; if it is alive, its acks of "
                           "these items are rejected (LeaseLost) and another worker does them again")
        return statements.requeue(conn, b, q.id, from_state, epoch=args.epoch, worker_id=wid,
                           lease_expired=args.expired, detail=f"wq-sql requeue: was {what}")

    try:
        _require_head(url, args.schema, rev)
        with engine.begin() as conn:
            rows = run(conn)
        if rows and qid is not None:
            notify.ring(engine, qid)  # workers waiting for these items claim them now
    finally:
        engine.dispose()
    if warning:
        print(warning, file=sys.stderr)
    per_epoch: dict[int, int] = {}
    for r in rows:
        per_epoch[r.epoch] = per_epoch.get(r.epoch, 0) + 1
    scope = f" of epoch {args.epoch}" if args.epoch is not None else ""
    detail = ", ".join(f"epoch {e}: {k}" for e, k in sorted(per_epoch.items()))
    print(f"requeued {len(rows)} item(s){scope} of queue {args.name!r} that were {what}"
          + (f" ({detail})" if len(per_epoch) > 1 else "") + "; they are pending again")
    return 0


PLOT_EXTRA = "pip install 'wq_sql[plot]'"


def cmd_report(args: argparse.Namespace) -> int:
    out = Path(args.out)
    kind = out.suffix.lower()
    if kind not in (".html", ".htm", ".svg", ".png"):
        raise CliError(f"--out {args.out!r}: write FILE.html (inline SVG), FILE.svg or FILE.png")
    if kind == ".png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CliError(f"a PNG report needs matplotlib: {PLOT_EXTRA} (or write --out FILE.html, "
                           "which needs nothing)") from None
    if not out.parent.is_dir():
        raise CliError(f"the folder of --out {args.out!r} does not exist")
    url = _url(args)
    with _checked_engine(args, url) as engine:
        t = _snapshot(engine, lambda conn: report.timeline(conn, _find_queue(conn, url, args.name)))
    if kind == ".png":
        report.render_png(t, str(out))
    else:
        out.write_text(report.render_svg(t) + "\n" if kind == ".svg" else report.render_html(t),
                       encoding="utf-8")
    print(f"wrote {out}: {len(t.workers)} worker lane(s), {len(t.bars)} deliveries, "
          f"{t.redeliveries} re-deliveries, {(t.t1 - t.t0).total_seconds():.1f} s")
    return 0


def _serving(what: str) -> Callable[[str], None]:
    def ready(address: str) -> None:
        print(f"serving {what} on {address} (Ctrl-C stops)", flush=True)
    return ready


def _check_window(args: argparse.Namespace) -> None:
    if not math.isfinite(args.window) or args.window <= 0:
        raise CliError(f"--window must be a positive number of seconds, got {args.window}")


def cmd_metrics(args: argparse.Namespace) -> int:
    _check_window(args)
    if args.top_k < 0:
        raise CliError(f"--top-k must be 0 or more, got {args.top_k}")
    from wq_sql.monitor import metrics

    url = _url(args)
    with _checked_engine(args, url) as engine:
        metrics.serve(engine, host=args.host, port=args.port, queues=args.queue or (),
                      per_worker=args.per_worker, top_k=args.top_k, window=args.window,
                      ready=_serving(f"Prometheus metrics of {_label(url, args.schema)}"))
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    _check_window(args)
    if not math.isfinite(args.minutes) or args.minutes <= 0:
        raise CliError(f"--minutes must be a positive number, got {args.minutes}")
    from wq_sql.monitor import dashboard

    url = _url(args)
    with _checked_engine(args, url) as engine:
        dashboard.serve(engine, _label(url, args.schema), host=args.host, port=args.port, queue=args.queue,
                        minutes=args.minutes, window=args.window,
                        ready=_serving(f"the dashboard of {_label(url, args.schema)}"))
    return 0


def cmd_reset(args: argparse.Namespace) -> int:
    url = _url(args)
    def read(conn: Connection) -> tuple[Any, int, int, int]:
        q = _find_queue(conn, url, args.name)
        done, failed, _ = statements.progress(conn, q.id)
        live = statements.live_workers(conn, q.id)
        return q, done, failed, live

    with _checked_engine(args, url) as engine:
        q, done, failed, live = _snapshot(engine, read)
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
    with _checked_engine(args, url) as engine:
        _snapshot(engine, lambda conn: _find_queue(conn, url, args.name))
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

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str,
            aliases: Sequence[str] = ()) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], help=help, description=help, aliases=list(aliases))
        sp.set_defaults(func=fn)
        return sp

    up = add("upgrade", cmd_upgrade, "create or upgrade the wq_sql schema (alias: migrate)", ["migrate"])
    up.add_argument("--sql", action="store_true",
                    help="print the DDL from the database's revision to head instead of running it")
    up.add_argument("--from", dest="from_rev", metavar="REV",
                    help="with --sql: start from revision REV without connecting (base: no schema yet)")
    add("current", cmd_current, "show the schema revision of the database")
    add("ls", cmd_ls, "list queues with their configuration and progress")
    cr = add("create", cmd_create, "create a queue ahead of the job (the rules and checks of WorkQueue(...))")
    cr.add_argument("name", metavar="NAME")
    src = cr.add_mutually_exclusive_group(required=True)
    src.add_argument("--works", nargs="+", metavar="WORK",
                     help="works, in order; an argument with * ? [ is a glob of local files, expanded "
                          "in sorted order (quote it); anything else is a work as given, e.g. hdfs://...; "
                          "relative paths are stored as given and each worker opens them relative to "
                          "its own working directory")
    src.add_argument("--works-from", metavar="FILE",
                     help="a text file listing one work per line (- for stdin; # starts a comment)")
    src.add_argument("--source", action="append", metavar="NAME=WORK",
                     help="a weighted queue: a work (or a quoted glob) of source NAME; repeat it for "
                          "more works and more sources ('web=data/web/*.txt' --source 'code=data/code/*')")
    cr.add_argument("--weights", metavar="WEIGHTS",
                    help="with --source: the sources' weights, e.g. web=0.7,code=0.3 (default: equal)")
    cr.add_argument("--epochs", type=int, default=1, help="num_epochs (default 1)")
    cr.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True,
                    help="shuffle each epoch (default: yes)")
    cr.add_argument("--seed", type=int, help="shuffle seed (default: a random one, printed)")
    cr.add_argument("--prefix", help="prepended to each work when it is handed out")
    cr.add_argument("--num-slices", type=int, help="num_slices, as in DeepRec")
    cr.add_argument("--max-attempts", type=int, help="failed deliveries before an item is failed "
                    "(default 3; for an existing queue, only checked against its value)")
    ex = add("extend", cmd_extend, "raise a queue's num_epochs (never lowers it); workers then join with "
             "the new num_epochs")
    ex.add_argument("name", metavar="NAME")
    ex.add_argument("--epochs", type=int, required=True, metavar="N", help="the new num_epochs")
    mx = add("mix", cmd_mix, "show a weighted queue's weights, their changes and the realized shares per "
             "epoch; with --set, change the weights of the running queue for every worker")
    mx.add_argument("name", metavar="NAME")
    mx.add_argument("--set", metavar="WEIGHTS",
                    help="new weights, every source named once: e.g. web=0.5,code=0.4,math=0.1 (they need "
                         "not sum to 1; 0 leaves a source out)")
    qu = add("quarantine", cmd_quarantine, "hold works back from every worker of a running queue (its "
             "items in flight are taken back) until unquarantined; without --work/--where, list them")
    qu.add_argument("name", metavar="NAME")
    named = qu.add_mutually_exclusive_group()
    named.add_argument("--work", metavar="PATTERN",
                       help="a work as stored, or a shell-style pattern over works: 'data/shard-00[3-5]*'")
    named.add_argument("--where", metavar="PREDICATE",
                       help="a plain SQL predicate over work, source, epoch, seq, state, attempts, worker, "
                            "last_error: \"state = 'failed' AND last_error LIKE '%%CRC%%'\"")
    qu.add_argument("--reason", metavar="TEXT", help="why (recorded with who and when)")
    uq = add("unquarantine", cmd_unquarantine, "give quarantined works back: their items are pending "
             "again, attempts from 0")
    uq.add_argument("name", metavar="NAME")
    back = uq.add_mutually_exclusive_group(required=True)
    back.add_argument("--work", metavar="PATTERN", help="as for quarantine")
    back.add_argument("--where", metavar="PREDICATE", help="as for quarantine")
    back.add_argument("--all", action="store_true", help="every work in quarantine")
    st = add("status", cmd_status, "items per epoch and state, and the live workers of a queue")
    st.add_argument("name", metavar="NAME")
    st.add_argument("--watch", action="store_true", help="redraw with a progress bar until the queue is done")
    st.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (default 2)")
    au = add("audit", cmd_audit, "who consumed what, re-deliveries, failures, and the exactly-once check "
             f"(exit {AUDIT_FAILED} if it fails)")
    au.add_argument("name", metavar="NAME")
    au.add_argument("--format", choices=["table", "csv", "json"], default="table")
    tr = add("trace", cmd_trace, "lineage (trained with lineage=True): the items and record ranges of "
             "a training step's batch, of the steps a checkpoint covered, or of the steps that trained "
             "on a work")
    tr.add_argument("name", metavar="NAME")
    what = tr.add_mutually_exclusive_group(required=True)
    what.add_argument("--step", type=int, metavar="N", help="step N of each rank (0-based: the batches "
                      "its DataLoader yielded before it), in the rank's latest run that recorded it")
    what.add_argument("--checkpoint", type=int, metavar="S",
                      help="the steps that trained the items the checkpoint at global step S covered")
    what.add_argument("--work", metavar="WORK", help="every step that trained on WORK (as stored, or as "
                      "handed out with the queue's prefix)")
    tr.add_argument("--to", type=int, metavar="M", help="with --step N: steps N to M (both included)")
    tr.add_argument("--worker", metavar="W", help="one rank's identity (as wq-sql status lists them)")
    tr.add_argument("--run", type=int, metavar="R", help="one run of the rank (its starts and restores "
                    "are numbered from 1)")
    tr.add_argument("--format", choices=["table", "json"], default="table")
    rq = add("requeue", cmd_requeue, "put items back to pending in one transaction, reporting how many")
    rq.add_argument("name", metavar="NAME")
    which = rq.add_mutually_exclusive_group(required=True)
    which.add_argument("--failed", action="store_true",
                       help="failed items (their attempts start again at 0)")
    which.add_argument("--expired", action="store_true",
                       help="claimed items whose lease has expired (no attempt counted)")
    which.add_argument("--worker", metavar="W",
                       help="claimed items held by worker W, e.g. one you killed (no attempt counted)")
    which.add_argument("--done", action="store_true", help="done items, to consume them again")
    rq.add_argument("--epoch", type=int, metavar="E", help="only items of epoch E")
    rp = add("report", cmd_report, "a timeline picture: one lane per worker, one bar per delivery, "
             "colored by epoch, re-deliveries marked")
    rp.add_argument("name", metavar="NAME")
    rp.add_argument("--out", required=True, metavar="FILE",
                    help=f"FILE.html (self-contained, inline SVG), FILE.svg, or FILE.png ({PLOT_EXTRA})")
    me = add("metrics", cmd_metrics, "serve Prometheus metrics computed from the database at each scrape "
             "(pip install 'wq_sql[metrics]')")
    me.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    me.add_argument("--port", type=int, default=9464, help="port (default 9464; 0: any free one)")
    me.add_argument("--queue", action="append", metavar="NAME", help="only this queue (repeatable)")
    who = me.add_mutually_exclusive_group()
    who.add_argument("--per-worker", action="store_true", help="a series per worker for every worker "
                     "(default: only the --top-k slowest stragglers)")
    who.add_argument("--top-k", type=int, default=5, metavar="K",
                     help="per-worker series for at most K stragglers, slowest first (default 5)")
    me.add_argument("--window", type=float, default=60.0, metavar="S",
                    help="seconds over which rates are measured (default 60)")
    da = add("dashboard", cmd_dashboard, "serve a live web page of the queues: progress and ETA per epoch, "
             "workers by rate with stragglers marked, recent failures, the timeline")
    da.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    da.add_argument("--port", type=int, default=8464, help="port (default 8464; 0: any free one)")
    da.add_argument("--queue", metavar="NAME", help="only this queue (default: every queue, by name)")
    da.add_argument("--minutes", type=float, default=10.0, metavar="N",
                    help="the timeline and failures cover the last N minutes (default 10)")
    da.add_argument("--window", type=float, default=60.0, metavar="S",
                    help="seconds over which rates are measured (default 60)")
    rs = add("reset", cmd_reset, "start a queue over at epoch 0 (deletes its progress and history)")
    rs.add_argument("name", metavar="NAME")
    rs.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    dr = add("drop", cmd_drop, "delete a queue with its items and history")
    dr.add_argument("name", metavar="NAME")
    dr.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    return p


def _scrub(text: str) -> str:
    """One line, with any password a driver's message may echo masked (a ``password=`` DSN field,
    a URL's userinfo); URLs wq_sql shows are already ``safe_url``, so they stay pasteable."""
    return " ".join(mask_secrets(text).split())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``wq-sql`` command; returns the exit code."""
    args = _parser().parse_args(argv)
    for name, default in (("url", None), ("schema", None), ("debug", False)):
        if not hasattr(args, name):
            setattr(args, name, default)
    given = os.environ.get("PGCONNECT_TIMEOUT")
    os.environ.setdefault("PGCONNECT_TIMEOUT", PG_CONNECT_TIMEOUT)
    try:
        return _run(args)
    finally:  # for this command only: a program that calls main() keeps its own setting
        if given is None:
            os.environ.pop("PGCONNECT_TIMEOUT", None)


def _run(args: argparse.Namespace) -> int:
    bad = _not_utf8(args)
    if bad:
        # Undecodable bytes in argv arrive as lone surrogates, which no database can store.
        print(f"{PROG}: error: {bad} is not valid UTF-8 text; pass names, works and URLs in UTF-8",
              file=sys.stderr)
        return 1
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
        print(f"{PROG}: error: {_scrub(_describe(e))}", file=sys.stderr)
        return 1


def _not_utf8(args: argparse.Namespace) -> Optional[str]:
    """The first argument (its name, never its value: it may be a URL) that is not UTF-8 text."""
    for name, value in vars(args).items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return name.upper() if name == "name" else "--" + name.replace("_", "-")
    return None


def _describe(e: Exception) -> str:
    if isinstance(e, (CliError, WqSqlError)):
        return str(e)
    if isinstance(e, UnicodeError):
        return (f"text that is not valid UTF-8 ({e}); names, works (also file names found by a glob) "
                "and URLs must be UTF-8")
    if isinstance(e, CommandError):
        return (f"{e}; the database may have been migrated by a newer wq_sql: upgrade wq_sql "
                "(or run with --debug)")
    if isinstance(e, DBAPIError) and "database is locked" in str(e.orig):
        return ("the SQLite database stayed locked by other writers past its busy timeout (30 s); "
                "retry, or stop some workers first")
    if isinstance(e, DBAPIError):
        return f"database error: {_first_line(e.orig)} (run with --debug for details)"
    if isinstance(e, SQLAlchemyError):
        return f"{type(e).__name__}: {_first_line(e)} (run with --debug for details)"
    return f"unexpected {type(e).__name__}: {_first_line(e)} (run with --debug for the traceback)"
