"""Sliced sources on both backends: tables (own database and an alias), text files, a custom
source, several processes draining them, and bad input that must leave nothing behind."""

from __future__ import annotations

import collections
import datetime as dt
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from backends import ROOT, fresh_database
from sqlalchemy.sql.elements import quoted_name

import wq_sql
from wq_sql import InvalidInput, QueueNotFound, WorkQueue
from wq_sql.plan import cut, unslice
from wq_sql.sources import Slice, read_slice, register_database, register_source


def make_table(url: str, name: str, rows: list[tuple[Any, ...]], *, key: str = "id",
               columns: tuple[str, ...] = ("id", "payload"), composite: bool = False) -> sa.Table:
    engine = sa.create_engine(wq_sql.engine.resolve_url(url))
    md = sa.MetaData()
    name = quoted_name(name, True)  # "nothing" is a keyword of SQLite that SQLAlchemy does not quote
    if composite:
        table = sa.Table(name, md, sa.Column("day", sa.Date, primary_key=True),
                         sa.Column("n", sa.Integer, primary_key=True), sa.Column("payload", sa.Text))
    else:
        table = sa.Table(name, md, sa.Column(columns[0], sa.Integer, primary_key=(key == "id")),
                         *[sa.Column(c, sa.Text) for c in columns[1:]])
    md.create_all(engine)
    with engine.begin() as c:
        if rows:
            c.execute(sa.insert(table), [dict(zip(table.c.keys(), r)) for r in rows])
    engine.dispose()
    return table


def execute(url: str, sql: str, **params: Any) -> None:
    engine = sa.create_engine(wq_sql.engine.resolve_url(url))
    with engine.begin() as c:
        c.execute(sa.text(sql), params)
    engine.dispose()


def drain(wq: WorkQueue, **options: Any) -> dict[str, list[Any]]:
    return {str(item): list(wq.read(item, **options)) for item in wq}


# ---------------------------------------------------------------- tables


def test_a_table_is_counted_cut_and_read_exactly_once(db_url: str) -> None:
    rows = [(i * 3, f"row {i}") for i in range(1000)]
    make_table(db_url, "events", rows)
    with WorkQueue(["table:events"], num_slices=7, shuffle=False, url=db_url) as wq:
        assert wq.items_per_epoch == 7
        got = drain(wq)
    assert list(got) == [f"table:events?start={s}&end={e}" for s, e in cut(1000, 7)]
    for name, recs in got.items():
        start, end = (int(x.split("=")[1]) for x in name.split("?")[1].split("&"))
        assert recs == rows[start:end]  # positions in key order, end exclusive, in key order


def test_num_slices_is_spread_over_tables_by_row_count(db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    for name, n in (("small", 100), ("mid", 300), ("large", 600), ("nothing", 0)):
        make_table(db_url, name, [(i, "x") for i in range(n)])
    with caplog.at_level(logging.WARNING, logger="wq_sql"):
        wq = WorkQueue(["table:small", "table:mid", "table:large", "table:nothing"], num_slices=10,
                       shuffle=False, url=db_url)
    per_table = collections.Counter(str(i).split("?")[0] for i in wq)
    wq.close()
    assert per_table == {"table:small": 1, "table:mid": 3, "table:large": 6}
    assert "'table:nothing' is empty" in caplog.text


def test_fewer_slices_than_tables_gives_one_item_per_table(db_url: str) -> None:
    for name in ("a", "b", "c"):
        make_table(db_url, name, [(i, name) for i in range(5)])
    with WorkQueue(["table:a", "table:b", "table:c"], num_slices=2, url=db_url) as wq:
        assert wq.items_per_epoch == 3
        assert sorted(r for item in wq for r in wq.read(item, columns=["payload"])) == \
            [("a",)] * 5 + [("b",)] * 5 + [("c",)] * 5


def test_reads_follow_the_key_range_counted_at_creation(db_url: str) -> None:
    make_table(db_url, "log", [(i * 10, f"v{i}") for i in range(100)])  # keys 0 .. 990
    wq = WorkQueue(["table:log"], num_slices=4, shuffle=False, url=db_url, lease_ahead=4)
    execute(db_url, "DELETE FROM log WHERE id IN (0, 250, 990)")
    execute(db_url, "INSERT INTO log VALUES (5, 'new inside'), (995, 'beyond the last key'), "
                    "(-1, 'before the first key')")
    got = [r for item in wq for r in wq.read(item)]
    wq.close()
    kept = [(i * 10, f"v{i}") for i in range(100) if i * 10 not in (0, 250, 990)]
    expected = sorted(kept + [(5, "new inside")])
    assert sorted(got) == expected          # each row in [first, last key] once; later tails not read


def test_composite_and_named_keys(db_url: str) -> None:
    day = dt.date(2026, 1, 1)
    rows = [(day + dt.timedelta(days=d), n, f"{d}/{n}") for d in range(10) for n in range(7)]
    make_table(db_url, "daily", rows, composite=True)
    make_table(db_url, "nokey", [(i, str(i)) for i in range(50)], key="none")
    with WorkQueue(["table:daily", "table:nokey?key=id"], num_slices=9, shuffle=False, url=db_url) as wq:
        got = drain(wq, columns=["payload"])
    daily = [r for k, v in got.items() if k.startswith("table:daily") for r in v]
    assert daily == [(p,) for _, _, p in rows]
    nokey = [int(r[0]) for k, v in got.items() if k.startswith("table:nokey") for r in v]
    assert sorted(nokey) == list(range(50))


CREATOR = """
import sys
from wq_sql import WorkQueue
wq = WorkQueue(["table:events"], num_slices=25, url=sys.argv[1], worker=sys.argv[2])
print(wq.items_per_epoch)
wq.close()
"""


def test_concurrent_creators_end_with_one_copy(db_url: str) -> None:
    make_table(db_url, "events", [(i, "x") for i in range(5000)])
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", CREATOR, db_url, f"w{i}"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert {o.strip() for o, _ in outs} == {"25"}
    engine = sa.create_engine(wq_sql.engine.resolve_url(db_url))
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM wq_queues")).scalar_one() == 1
        assert c.execute(sa.text("SELECT count(*) FROM wq_works")).scalar_one() == 25
        assert c.execute(sa.text("SELECT count(*) FROM wq_items")).scalar_one() == 25
    engine.dispose()


def test_a_table_of_another_database_by_alias(backend: str, db_url: str, tmp_path: Path,
                                              request: pytest.FixtureRequest) -> None:
    other = fresh_database(backend, tmp_path, request, "warehouse", migrated=False)
    other_url = next(other)
    try:
        make_table(other_url, "clicks", [(i, f"c{i}") for i in range(40)])
        assert wq_sql.register_database is register_database  # the README's spelling
        wq_sql.register_database("warehouse", other_url)
        with WorkQueue(["table://warehouse/clicks"], num_slices=4, url=db_url) as wq:
            got = sorted(r for recs in drain(wq).values() for r in recs)
            rows = [(r.work,) for r in sa.create_engine(wq_sql.engine.resolve_url(db_url)).connect()
                    .execute(sa.text("SELECT work FROM wq_audit"))]
        assert got == [(i, f"c{i}") for i in range(40)]
        assert all("warehouse" in w and "@" not in w and "//" in w for (w,) in rows)
    finally:
        next(other, None)


def test_works_with_credentials_or_unknown_aliases_are_refused(db_url: str) -> None:
    with pytest.raises(InvalidInput, match="alias"):
        WorkQueue(["table://postgres:secret@db.example/clicks"], num_slices=2, url=db_url)
    with pytest.raises(InvalidInput, match="register_database"):
        WorkQueue(["table://nowhere/clicks"], num_slices=2, url=db_url)
    with pytest.raises(QueueNotFound):
        WorkQueue.attach(url=db_url)


PW = "Secr3tPw"


@pytest.mark.parametrize("work, shown", [
    (f"table://reader:{PW}@dwh/events", "work 'table://reader:***@dwh/events' carries connection details"),
    (f"table://reader:{PW}@dwh/events?key=id", "'table://reader:***@dwh/events?key=id'"),
    (f"table:postgresql://reader:{PW}@dwh/events",
     "table name 'postgresql://reader:***@dwh/events' in 'table:postgresql://reader:***@dwh/events'"),
    (f"table:events?postgresql://reader:{PW}@dwh/x", "['postgresql://reader:***@dwh/x']"),
    (f"table:events?key=postgresql://reader:{PW}@dwh/x", "key columns 'postgresql://reader:***@dwh/x'"),
    (f"lines:postgresql://reader:{PW}@dwh/absent.txt",
     "cannot read 'postgresql://reader:***@dwh/absent.txt' of work 'lines:postgresql://reader:***@dwh/"),
    ("table://reader:S3cr@t/Pw0rd@dwh/events", "'table://reader:***@dwh/events'"),  # "@", "/" unquoted
])
def test_refused_works_never_show_their_password(db_url: str, work: str, shown: str) -> None:
    with pytest.raises(InvalidInput) as e:
        WorkQueue([work], num_slices=2, url=db_url)
    message = str(e.value)
    assert shown in message                                      # the rest of the URL is still shown
    assert PW not in message and "S3cr" not in message and "Pw0rd" not in message
    assert wq_sql.list_queues(db_url) == []


def test_file_messages_never_show_a_password_in_the_path(db_url: str, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    folder = f"{tmp_path}/postgresql://reader:{PW}@dwh"  # a path may hold a URL ("//" is "/")
    os.makedirs(folder)
    Path(folder, "empty.txt").write_bytes(b"")
    grows = Path(folder, "grows.txt")
    grows.write_bytes(b"a\nb\n")
    works = [f"lines:{folder}/empty.txt", f"lines:{folder}/grows.txt"]
    with caplog.at_level(logging.WARNING, logger="wq_sql"), \
            WorkQueue(works, num_slices=2, url=db_url) as wq:
        item = next(iter(wq))
        grows.write_bytes(b"a\nb\nc\n")
        with pytest.raises(wq_sql.WqSqlError, match="no longer match") as e:
            list(wq.read(item))
    assert "postgresql://reader:***@dwh/grows.txt" in str(e.value) and PW not in str(e.value)
    assert "postgresql://reader:***@dwh/empty.txt' is empty" in caplog.text and PW not in caplog.text
    with pytest.raises(InvalidInput, match="plain identifier") as e:  # the arguments swapped
        register_database(f"postgresql://reader:{PW}@dwh/x", "warehouse")
    assert "postgresql://reader:***@dwh/x" in str(e.value) and PW not in str(e.value)
    with pytest.raises(InvalidInput, match="no source is registered") as e:
        read_slice(json.dumps({"work": f"nosuch://reader:{PW}@dwh/x", "start": 0, "end": 1, "bounds": {}}),
                   sa.create_engine("sqlite://"))
    assert "'nosuch://reader:***@dwh/x'" in str(e.value) and PW not in str(e.value)


def test_sliced_reads_quote_names_and_bind_key_values(db_url: str) -> None:
    make_table(db_url, "events", [(i * 7919, f"r{i}") for i in range(300)])
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    sa.event.listen(sa.Engine, "before_cursor_execute", record)
    try:
        with WorkQueue(["table:events"], num_slices=5, url=db_url) as wq:
            got = [r for item in wq for r in wq.read(item)]
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", record)
    assert len(got) == 300
    source_sql = [s for s in statements if "events" in s and "wq_" not in s]
    assert source_sql and all('"events"' in s for s in source_sql)  # identifiers always quoted
    cut_keys = [str(7919 * p) for p, _ in cut(300, 5)[1:]]
    assert not [s for s in source_sql for k in cut_keys if k in s]  # key bounds are parameters


@pytest.mark.parametrize("work, message", [
    ("table:missing", "does not exist"),
    ('table:"events"; DROP TABLE wq_items; --', "letters, digits and _"),
    ("table:a.b.c", "letters, digits and _"),
    ("table:events?key=id;drop", "plain identifiers"),
    ("table:events?limit=3", "unknown parameter"),
    ("table:events?key=nope", "not in table"),
])
def test_bad_table_works_leave_no_queue(db_url: str, work: str, message: str) -> None:
    make_table(db_url, "events", [(1, "x")])
    with pytest.raises(InvalidInput, match=message):
        WorkQueue([work], num_slices=3, url=db_url)
    assert wq_sql.list_queues(db_url) == []


def test_null_keys_and_empty_queues_are_refused(db_url: str) -> None:
    make_table(db_url, "loose", [(None, "a"), (1, "b")], key="none")
    with pytest.raises(InvalidInput, match="NULL key"):
        WorkQueue(["table:loose?key=id"], url=db_url)
    make_table(db_url, "void", [])
    with pytest.raises(InvalidInput, match="every work is empty"):
        WorkQueue(["table:void"], num_slices=4, url=db_url)
    with pytest.raises(InvalidInput, match="num_slices"):
        WorkQueue(["table:void"], num_slices=0, url=db_url)
    with pytest.raises(InvalidInput, match="prefix"):
        WorkQueue(["table:void"], prefix="/data/", url=db_url)
    assert wq_sql.list_queues(db_url) == []


def test_joining_workers_do_not_count_again(db_url: str) -> None:
    make_table(db_url, "events", [(i, "x") for i in range(30)])
    first = WorkQueue(["table:events"], num_slices=3, url=db_url, worker="a")
    execute(db_url, "DROP TABLE events")  # a joiner that counted would fail here
    second = WorkQueue(["table:events"], num_slices=3, url=db_url, worker="b")
    assert second.items_per_epoch == 3
    first.close()
    second.close()


# ---------------------------------------------------------------- files and custom sources


def test_lines_works_are_opt_in_and_plain_paths_stay_whole(db_url: str, tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    big.write_bytes(b"".join(b"line %d\n" % i for i in range(3000)) + b"last, no newline")
    plain = tmp_path / "plain.txt"
    plain.write_text("kept whole\n")
    with WorkQueue([f"lines:{big}", str(plain)], num_slices=12, shuffle=False, url=db_url,
                   lease_ahead=12) as wq:
        items = list(wq.take_many(100))
        assert str(plain) in items and len(items) == 12
        lines = [r for item in items if item != str(plain) for r in wq.read(item)]
        with pytest.raises(InvalidInput, match="plain work"):
            wq.read(items[-1])
    assert lines == [b"line %d" % i for i in range(3000)] + [b"last, no newline"]


def test_unreadable_files_are_refused(db_url: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="cannot read"):
        WorkQueue([f"lines:{tmp_path / 'absent.txt'}"], num_slices=2, url=db_url)
    with pytest.raises(InvalidInput, match="not a regular file|cannot read"):
        WorkQueue([f"lines:{tmp_path}"], num_slices=2, url=db_url)
    assert wq_sql.list_queues(db_url) == []


def test_a_file_whose_name_holds_query_characters_round_trips(db_url: str, tmp_path: Path) -> None:
    odd = tmp_path / "what?.txt&start=1&end=2=x"
    lines = [b"line %d" % i for i in range(400)]
    odd.write_bytes(b"\n".join(lines) + b"\n")
    work = f"lines:{odd}"
    with WorkQueue([work], num_slices=6, shuffle=False, url=db_url) as wq:
        got = drain(wq)
    ranges = []
    for item in got:  # always "?start=..&end=.." appended to the work as given
        m = re.fullmatch(re.escape(work) + r"\?start=([0-9]+)&end=([0-9]+)", item)
        assert m, item
        ranges.append((int(m[1]), int(m[2])))
        assert unslice(item) == work
    assert ranges == cut(odd.stat().st_size, 6)
    assert [r for recs in got.values() for r in recs] == lines  # every line once, in order


class Numbers:
    """A custom source: ``range:<n>`` holds the records 0 .. n-1."""

    scheme = "range"

    def check(self, work: str) -> None:
        if not work[6:].isdigit():
            raise InvalidInput(f"{work!r}: write range:<n>")

    def size(self, work: str, engine: sa.Engine) -> int:
        return int(work[6:])

    def slices(self, work: str, engine: sa.Engine, k: int) -> list[Slice]:
        return [Slice(s, e, {"n": self.size(work, engine)}) for s, e in cut(self.size(work, engine), k)]

    def read(self, work: str, piece: Slice, engine: sa.Engine, **options: Any) -> Iterator[int]:
        return iter(range(piece.start, piece.end))


def test_a_registered_source_plugs_in_without_touching_the_claim_code(db_url: str) -> None:
    register_source(Numbers(), replace=True)
    with pytest.raises(InvalidInput, match="range:<n>"):
        WorkQueue(["range:ten"], url=db_url)
    with WorkQueue(["range:1000", "range:10"], num_slices=11, url=db_url) as wq:
        got = sorted(r for item in wq for r in wq.read(item))
    assert got == sorted(list(range(1000)) + list(range(10)))


def test_records_iterates_every_record_of_every_item(db_url: str) -> None:
    make_table(db_url, "events", [(i, f"r{i}") for i in range(200)])
    with WorkQueue(["table:events"], num_slices=8, url=db_url) as wq:
        assert sorted(wq.records(columns=["id"])) == [(i,) for i in range(200)]
        assert wq.progress().done == 8


# ---------------------------------------------------------------- several processes

WORKER = """
import json, pathlib, sys, time
from wq_sql import WorkQueue
url, out, barrier = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[4])
with WorkQueue(json.loads(sys.argv[3]), num_slices=40, num_epochs=2, url=url, seed=3) as wq, \\
        open(out, "w") as f:
    # Start together (bounded): on a busy machine one process's imports can take longer than
    # another's whole drain, and the check that the work was shared would fail by timing.
    (barrier / pathlib.Path(out).name).touch()
    deadline = time.monotonic() + 60
    while len(list(barrier.iterdir())) < int(sys.argv[5]) and time.monotonic() < deadline:
        time.sleep(0.02)
    for item in wq:
        for rec in wq.read(item):
            f.write(json.dumps([item.epoch, list(rec) if isinstance(rec, tuple) else rec.decode()]) + "\\n")
        time.sleep(0.01)
"""


def test_several_processes_read_every_record_once_per_epoch(db_url: str, tmp_path: Path) -> None:
    rows = [(i, f"t{i}") for i in range(2000)]
    make_table(db_url, "events", rows)
    text = tmp_path / "text.txt"
    text.write_bytes(b"".join(b"f%d\n" % i for i in range(3000)))
    works = json.dumps(["table:events", f"lines:{text}"])
    outs = [tmp_path / f"out{i}.jsonl" for i in range(4)]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    (tmp_path / "barrier").mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, db_url, str(o), works, str(tmp_path / "barrier"),
                               str(len(outs))], env=env,
                              stderr=subprocess.PIPE, text=True) for o in outs]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    got: collections.Counter[str] = collections.Counter()
    per_worker = []
    for o in outs:
        lines = o.read_text().splitlines()
        per_worker.append(len(lines))
        got.update(lines)
    expected = collections.Counter(json.dumps([e, [i, f"t{i}"]]) for e in range(2) for i in range(2000))
    expected.update(json.dumps([e, f"f{i}"]) for e in range(2) for i in range(3000))
    assert got == expected
    assert sum(1 for n in per_worker if n) >= 2  # the work was shared


def test_the_operator_command_creates_sliced_queues(db_url: str) -> None:
    make_table(db_url, "events", [(i, "x") for i in range(90)])
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-m", "wq_sql", "create", "sliced", "--url", db_url, "--works",
                        "table:events?key=id", "--num-slices", "3", "--no-shuffle"],
                       env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr  # "?" in a table work is not a glob
    with WorkQueue(["table:events?key=id"], num_slices=3, name="sliced", url=db_url, shuffle=False) as wq:
        assert [str(i) for i in wq] == [f"table:events?key=id?start={s}&end={e}" for s, e in cut(90, 3)]
