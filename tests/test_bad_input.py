"""Bad input, property-tested with hypothesis, on both backends.

Every property has the same shape: a value is either refused with a clear wq_sql error (an
``InvalidInput`` naming the argument and what it must be) or handled correctly (the works taken
back are the works given, after DeepRec's strip, each exactly once per epoch). Either way the
database is never corrupted: a queue created before the bad input (the *bystander*) keeps its
items, history, counters and workers, and SQLite's ``PRAGMA integrity_check`` says ``ok``.

Examples are derandomized and the example database is off, so CI sees the same inputs every run.
Hypothesis runs many examples in one function-scoped database, so every example uses its own
queue name and drops its queue at the end.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import pytest
import sqlalchemy as sa
from backends import BACKENDS, fresh_database
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import wq_sql
from wq_sql import InvalidInput, QueueExhausted, WorkItem, WorkQueue, WqSqlError
from wq_sql import cli as wq_cli
from wq_sql.store.engine import resolve_url

ROOT = Path(__file__).resolve().parent.parent

PROPERTY = settings(
    max_examples=15, deadline=None, derandomize=True, database=None, print_blob=False,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)

_counter = itertools.count()


def unique(tag: str) -> str:
    return f"{tag}-{os.getpid()}-{next(_counter)}"


def open_queue(works: Any, url: str, **kw: Any) -> WorkQueue:
    kw.setdefault("name", unique("q"))
    kw.setdefault("worker", "tester")
    kw.setdefault("busy_timeout", 10)
    return WorkQueue(works, url=url, **kw)


# ---------------------------------------------------------------- the bystander


class Bystander:
    """A queue with some history (done items, a failed attempt with its error, two workers),
    created before any bad input; :meth:`check` asserts that nothing of it changed."""

    NAME = "bystander-\u2603-b7e1"

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = sa.create_engine(resolve_url(url), poolclass=sa.pool.NullPool)
        with WorkQueue([f"b{i}" for i in range(6)], num_epochs=2, seed=3, name=self.NAME, url=url,
                       worker="by-1", busy_timeout=10) as wq:
            got = [wq.take() for _ in range(4)]  # three acked by the takes after them
            wq.fail(got[-1], "bystander's own error")
            wq.take()                            # acked by close()
        with WorkQueue.attach(self.NAME, url=url, worker="by-2", busy_timeout=10) as wq:
            wq.take()
        self.before = self.snapshot()
        assert self.before["items"], "the bystander has no rows"

    def snapshot(self) -> dict[str, Any]:
        with self.engine.connect() as c:
            qid = c.execute(sa.text("SELECT id FROM wq_queues WHERE name = :n"),
                            {"n": self.NAME}).scalar_one()

            def rows(sql: str) -> list[tuple[Any, ...]]:
                return [tuple(r) for r in c.execute(sa.text(sql), {"q": qid, "n": self.NAME})]

            return {
                "queue": rows("SELECT * FROM wq_queues WHERE id = :q"),
                "works": rows("SELECT idx, work FROM wq_works WHERE queue_id = :q ORDER BY idx"),
                "items": rows("SELECT * FROM wq_audit WHERE queue = :n ORDER BY epoch, seq"),
                "history": rows("SELECT * FROM wq_history WHERE queue = :n ORDER BY event_id"),
                "tallies": rows("SELECT * FROM wq_tallies WHERE queue_id = :q "
                                "ORDER BY epoch, worker_id"),
                "workers": rows("SELECT name, incarnation, heartbeat_at FROM wq_workers "
                                "WHERE queue_id = :q ORDER BY name"),
            }

    def check(self) -> None:
        assert self.snapshot() == self.before, "the bystander queue changed"
        if self.engine.dialect.name == "sqlite":
            with self.engine.connect() as c:
                assert c.exec_driver_sql("PRAGMA integrity_check").scalars().all() == ["ok"]
                assert c.exec_driver_sql("PRAGMA foreign_key_check").all() == []


@pytest.fixture
def bystander(db_url: str) -> Iterator[Bystander]:
    b = Bystander(db_url)
    yield b
    b.check()
    b.engine.dispose()


def drop(url: str, name: Any) -> None:
    if isinstance(name, str):
        try:
            wq_sql.drop_queue(name, url)
        except WqSqlError:
            pass


def stored_works(b: Bystander, name: str) -> list[str]:
    with b.engine.connect() as c:
        return [r[0] for r in c.execute(sa.text("SELECT work FROM wq_audit WHERE queue = :n AND epoch = 0 "
                                                "ORDER BY seq"), {"n": name})]


# ---------------------------------------------------------------- what "correct" means


def expected_works(works: Sequence[Any]) -> list[str]:
    """DeepRec's normalisation: bytes decoded as UTF-8, every work stripped."""
    return [(w.decode("utf-8") if isinstance(w, bytes) else w).strip() for w in works]


def check_taken(items: Sequence[WorkItem], works: Sequence[str], prefix: Optional[str],
                num_epochs: int, exhausted: bool) -> None:
    """Each epoch hands out each work exactly once (a prefix of epochs, the last one possibly
    partly taken); every item is ``prefix + work``."""
    per_epoch: dict[int, list[str]] = defaultdict(list)
    for it in items:
        assert isinstance(it, str) and str(it) == (prefix or "") + it.work
        per_epoch[it.epoch].append(it.work)
    epochs = sorted(per_epoch)
    assert epochs == list(range(len(epochs))), epochs
    for e in epochs:
        got, want = Counter(per_epoch[e]), Counter(works)
        assert got == want if (e < epochs[-1] or exhausted) else not got - want, (e, got, want)
    if exhausted:
        assert len(epochs) == num_epochs


def take_upto(wq: WorkQueue, cap: int) -> tuple[list[WorkItem], bool]:
    items: list[WorkItem] = []
    try:
        while len(items) < cap:
            items.append(wq.take(timeout=30))
    except QueueExhausted:
        return items, True
    return items, False


def assert_clear(e: BaseException, *needles: str) -> None:
    """A wq_sql error (DeepRec's ValueError too, for InvalidInput) whose message names what is wrong."""
    assert isinstance(e, WqSqlError), f"{type(e).__name__}: {e}"
    msg = str(e)
    assert msg and "Traceback" not in msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


# ---------------------------------------------------------------- strategies

# Text any database stores: no NUL, no lone surrogate (those are separate properties).
SURROGATES: Any = ("Cs",)
TEXT = st.characters(exclude_categories=SURROGATES, exclude_characters="\x00")
TRICKY = [
    "'); DROP TABLE wq_items; --", "x' OR '1'='1", 'a"b', "back\\slash", "semi;colon", "%s", "%(q)s",
    "%%", "?", ":name", "$1", "{pairs}", "e\u0301\u0301", "\u00e9", "e\u0301", "\u202eevil.txt\u202c",
    "\u0645\u0631\u062d\u0628\u0627", "\U0001F600\U0001F4A9", "\ufeffbom", "\u200bzero-width",
    "line\nbreak", "tab\there", "\u3000ideographic space\u3000", "\x85nel\x85", "\u2028ls",
    "C:\\data\\part-0", "hdfs://nn:8020/path/part-0?x=1&y=2", "   ", "", "a\x00b", "\x00",
]
TRICKY_BYTES = [b"\xed\xa0\x80", b"\xff\xfe", b"\xc3", b"ok\xc3\xa9", b"  spaced  ", b"a\x00", b"\x80"]
# Works with a registered source scheme are counted and sliced (another property's business).
_SLICED = re.compile(r"^\s*(table|lines):", re.IGNORECASE)


def _plain(w: Any) -> bool:
    try:
        text = w.decode("utf-8") if isinstance(w, bytes) else w
    except UnicodeDecodeError:
        return True
    return not _SLICED.match(text)


WORK = st.one_of(
    st.text(TEXT, min_size=0, max_size=12),
    st.text(TEXT, min_size=1, max_size=12).map(lambda s: s.encode("utf-8")),
    st.sampled_from(TRICKY),
    st.sampled_from(TRICKY_BYTES),
    st.binary(max_size=6),
    st.text(st.characters(exclude_categories=SURROGATES), min_size=1, max_size=6),  # NUL allowed
).filter(_plain)


def _visible(name: str) -> bool:
    """A queue name needs a visible character (only spaces: refused, see test_open_errors)."""
    return any(c.isprintable() and not c.isspace() for c in name)


NAME = st.one_of(st.text(TEXT, min_size=1, max_size=20).filter(_visible),
                 st.sampled_from([t for t in TRICKY if _visible(t) and "\x00" not in t]),
                 st.just("\U0001F600" * 200), st.just("n" * 200))
PREFIX = st.one_of(st.none(), st.text(TEXT, max_size=8), st.sampled_from(TRICKY[:12]),
                   st.text(TEXT, max_size=8).map(lambda s: s.encode("utf-8")))

WRONG_TYPE = st.sampled_from([None, "1", b"1", 1j, [1], (1,), {"a": 1}])
NOT_NONE = WRONG_TYPE.filter(lambda v: v is not None)
NOT_INT = st.one_of(st.booleans(), st.floats(), NOT_NONE)  # 1.0 and True are not ints either
NOT_NUMBER = st.one_of(st.booleans(), WRONG_TYPE)


def positive_number(lo: float, hi: float) -> st.SearchStrategy[Any]:
    return st.one_of(st.floats(lo, hi), st.integers(math.ceil(lo), int(hi)))


def not_positive() -> st.SearchStrategy[Any]:
    return st.one_of(st.floats(max_value=0.0, allow_nan=False), st.integers(max_value=0),
                     st.sampled_from([math.nan, -math.inf]))


# argument -> (valid values, refused values). Edge values that once slipped through have their own
# tests below (test_edge_values_*).
ARGS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "num_epochs": (st.one_of(st.integers(1, 4), st.integers(1, 2**62)),
                   st.one_of(st.integers(max_value=0), st.integers(min_value=2**62 + 1), NOT_INT,
                             st.none())),
    "num_slices": (st.one_of(st.none(), st.integers(1, 2**31 - 1)),
                   st.one_of(st.integers(max_value=0), NOT_INT)),
    "seed": (st.one_of(st.none(), st.integers(0, 2**63 - 1)),
             st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63), NOT_INT)),
    "lease_seconds": (positive_number(10, 1e9), st.one_of(not_positive(), NOT_NUMBER)),
    "lease_ahead": (st.integers(1, 2**31 - 1), st.one_of(st.integers(max_value=0), NOT_INT, st.none())),
    "max_attempts": (st.one_of(st.none(), st.integers(1, 2**31 - 1)),
                     st.one_of(st.integers(max_value=0), NOT_INT)),
    "heartbeat_seconds": (st.one_of(st.none(), positive_number(1, 30)),
                          st.one_of(st.floats(max_value=-1e-9, allow_nan=False), st.integers(max_value=-1),
                                    st.just(math.nan), st.floats(30.5, 1e300), st.just(math.inf))),
    "poll_seconds": (st.one_of(positive_number(0.01, 1e6), st.just(math.inf)),
                     st.one_of(not_positive(), NOT_NUMBER)),
    "busy_timeout": (st.one_of(positive_number(1, 1e6), st.just(math.inf)),
                     st.one_of(not_positive(), NOT_NUMBER)),
    "max_item_seconds": (st.one_of(st.none(), positive_number(1, 1e9)),
                         st.one_of(not_positive(), st.booleans(), NOT_NONE)),
    "prefix": (PREFIX, st.one_of(st.integers(), st.just(["p"]),
                                 st.text(TEXT, max_size=3).map(lambda s: s + "\x00"),
                                 st.sampled_from([b"\xff", b"\xed\xa0\x80"]))),
    "name": (NAME, st.one_of(st.just(""), st.text(TEXT, min_size=201, max_size=230), st.just("q\x00"),
                             st.just(b"q"), st.none(), st.integers(), st.sampled_from([" ", "\t\u200b"]))),
    "worker": (st.text(TEXT, min_size=1, max_size=20).filter(str.strip),
               st.one_of(st.sampled_from(["", "   ", "w\x00", "w\ud800", "\udcff"]), st.just(b"w"),
                         st.text(TEXT, min_size=201, max_size=230).filter(lambda s: len(s.strip()) > 200),
                         st.integers())),
}


@st.composite
def one_argument(draw: st.DrawFn) -> tuple[str, Any, bool]:
    arg = draw(st.sampled_from(sorted(ARGS)))
    refused = draw(st.booleans())
    good, bad = ARGS[arg]
    return arg, draw(bad if refused else good), refused


# ---------------------------------------------------------------- constructor arguments


@PROPERTY
@given(case=one_argument())
@example(case=("num_epochs", 2**63, True))
@example(case=("num_epochs", 2**62, False))
@example(case=("name", "'); DROP TABLE wq_items; --", False))
@example(case=("name", 'q"\\;--', False))
@example(case=("name", " \u200b\t", True))
@example(case=("worker", "w\ud800", True))
@example(case=("heartbeat_seconds", 31.0, True))
def test_constructor_arguments(db_url: str, bystander: Bystander, case: tuple[str, Any, bool]) -> None:
    arg, value, refused = case
    works: list[Any] = ["w0", " w1 ", b"w2"]
    kw: dict[str, Any] = {"num_epochs": 2, "name": unique("args"), "worker": "tester", "busy_timeout": 10,
                          arg: value}
    try:
        try:
            wq = WorkQueue(works, url=db_url, **kw)
        except Exception as e:
            assert refused, f"{arg}={value!r} was refused: {type(e).__name__}: {e}"
            assert_clear(e, arg)
            assert isinstance(e, InvalidInput) and isinstance(e, ValueError)
            return
        assert not refused, f"{arg}={value!r} was accepted"
        with wq:
            if arg in ("num_epochs", "seed", "lease_ahead", "max_attempts", "num_slices", "name",
                       "worker") and value is not None:
                assert getattr(wq, arg) == (value.strip() if arg == "worker" else value)
            items, exhausted = take_upto(wq, 7)
        prefix = kw.get("prefix")
        check_taken(items, expected_works(works), prefix.decode() if isinstance(prefix, bytes) else prefix,
                    kw["num_epochs"], exhausted)
    finally:
        drop(db_url, kw["name"])
        bystander.check()


# ---------------------------------------------------------------- works


def normalize_or_error(works: Sequence[Any]) -> tuple[Optional[list[str]], tuple[str, ...]]:
    """What wq_sql must do with ``works``: the normalised list, or the words its error names."""
    out = []
    for i, w in enumerate(works):
        if isinstance(w, bytes):
            try:
                w = w.decode("utf-8")
            except UnicodeDecodeError:
                return None, (f"works[{i}]", "UTF-8")
        w = w.strip()
        if "\x00" in w:
            return None, (f"works[{i}]", "NUL")
        if not w:
            return None, (f"works[{i}]", "empty")
        out.append(w)
    return out, ()


@PROPERTY
@given(works=st.lists(WORK, min_size=1, max_size=6), num_epochs=st.integers(1, 3), shuffle=st.booleans(),
       seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)), prefix=PREFIX, lease_ahead=st.integers(1, 4),
       as_tuple=st.booleans())
@example(works=["'); DROP TABLE wq_items; --", "x'; DELETE FROM wq_queues; --", "%(q)s", "?"], num_epochs=2,
         shuffle=True, seed=None, prefix="'; --", lease_ahead=1, as_tuple=False)
@example(works=["e\u0301", "\u00e9", "\u202eevil\u202c", "\U0001F600", " \u3000x\u3000 "], num_epochs=1,
         shuffle=False, seed=None, prefix=None, lease_ahead=2, as_tuple=True)
@example(works=[b"\xed\xa0\x80"], num_epochs=1, shuffle=False, seed=None, prefix=None, lease_ahead=1,
         as_tuple=False)
@example(works=["ok", "a\x00b"], num_epochs=1, shuffle=False, seed=None, prefix=None, lease_ahead=1,
         as_tuple=False)
def test_works_round_trip(db_url: str, bystander: Bystander, works: list[Any], num_epochs: int,
                          shuffle: bool, seed: Optional[int], prefix: Any, lease_ahead: int,
                          as_tuple: bool) -> None:
    expected, needles = normalize_or_error(works)
    name = unique("works")
    given_works: Any = tuple(works) if as_tuple else works
    kw: dict[str, Any] = {"num_epochs": num_epochs, "shuffle": shuffle, "seed": seed, "prefix": prefix,
                          "lease_ahead": lease_ahead, "name": name}
    try:
        try:
            wq = open_queue(given_works, db_url, **kw)
        except Exception as e:
            assert expected is None, f"{works!r} refused: {type(e).__name__}: {e}"
            assert_clear(e, *needles)
            assert name not in [q["name"] for q in wq_sql.list_queues(db_url)]
            return
        assert expected is not None, f"{works!r} accepted, expected an error naming {needles}"
        with wq:
            # A second worker joins with the same works: the stored digest matches the given text.
            with open_queue(given_works, db_url, **kw, worker="joiner") as other:
                first = other.take()
            items, exhausted = take_upto(wq, 3 * 6 + 1)
        assert exhausted
        p = prefix.decode("utf-8") if isinstance(prefix, bytes) else prefix
        check_taken([first, *items], expected, p, num_epochs, exhausted=True)
        # The database keeps the exact text (no trimming, normalisation or truncation).
        assert sorted(stored_works(bystander, name)) == sorted(expected)
    finally:
        drop(db_url, name)
        bystander.check()


def test_very_long_works(db_url: str, bystander: Bystander) -> None:
    mb = 1 << 20
    works = ["x" * mb, "\U0001F600" * (mb // 4), "e\u0301" * (mb // 3), "  " + "\u0645" * (mb // 2) + "  \n",
             (b"\xc3\xa9" * (mb // 2))]
    expected = expected_works(works)
    name = unique("long")
    with open_queue(works, db_url, name=name, num_epochs=2, prefix="/" * 1000, lease_ahead=3) as wq:
        items, exhausted = take_upto(wq, 11)
    assert exhausted
    check_taken(items, expected, "/" * 1000, 2, exhausted=True)
    assert sorted(stored_works(bystander, name)) == sorted(expected)
    for arg, value in (("name", "n" * mb), ("worker", "w" * mb)):
        with pytest.raises(InvalidInput, match=f"{arg} must be"):
            open_queue(["a"], db_url, **{arg: value})
    drop(db_url, name)


def test_nul_is_refused_everywhere(db_url: str, bystander: Bystander) -> None:
    # (where, works, keyword arguments, what the message must name). The queue name's message
    # does not say what is wrong with it (queue.py's _check_name), so only "name" is asked there.
    cases: list[tuple[str, list[Any], dict[str, Any], tuple[str, ...]]] = [
        ("work", ["ok", "a\x00b"], {}, ("works[1]", "NUL")),
        ("work bytes", ["ok", b" \x00 "], {}, ("works[1]", "NUL")),
        ("name", ["ok"], {"name": "x\x00y"}, ("name",)),
        ("prefix", ["ok"], {"prefix": "p\x00"}, ("prefix", "NUL")),
        ("prefix bytes", ["ok"], {"prefix": b"p\x00"}, ("prefix", "NUL")),
        ("worker", ["ok"], {"worker": "x\x00y"}, ("worker", "NUL")),
    ]
    for where, works, kw, needles in cases:
        with pytest.raises(InvalidInput) as info:
            open_queue(works, db_url, **kw)
        try:
            assert_clear(info.value, *needles)
        except AssertionError as e:
            raise AssertionError(f"NUL in the {where}: {e}") from None
    assert [q["name"] for q in wq_sql.list_queues(db_url)] == [Bystander.NAME]


# ---------------------------------------------------------------- huge num_epochs


def test_huge_num_epochs(db_url: str, bystander: Bystander, capsys: pytest.CaptureFixture[str],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "10")
    for bad in (2**62 + 1, 2**63, 2**64, -(2**63), 0):
        with pytest.raises(InvalidInput, match="num_epochs"):
            open_queue(["a"], db_url, num_epochs=bad)
    name = unique("huge")
    with open_queue(["a", "b"], db_url, name=name, num_epochs=2**62, seed=5) as wq:
        items, exhausted = take_upto(wq, 7)
        assert not exhausted
        check_taken(items, ["a", "b"], None, 2**62, exhausted=False)
        p = wq.progress()
        assert (p.total, p.num_epochs, p.remaining) == (2 * 2**62, 2**62, 2 * 2**62 - 6)
        wq.extend_epochs(2**62)  # the same count: allowed, nothing changes
        with pytest.raises(InvalidInput, match="num_epochs"):
            wq.extend_epochs(2**62 + 1)
    # A worker that joins sees the same configuration; every operator view handles the numbers.
    with WorkQueue.attach(name, url=db_url, worker="joiner") as wq:
        assert wq.num_epochs == 2**62 and wq.take().epoch == 3
    [row] = [q for q in wq_sql.list_queues(db_url) if q["name"] == name]
    assert row["total"] == 2**63 and row["num_epochs"] == 2**62
    capsys.readouterr()
    for argv in (["ls"], ["status", name], ["audit", name, "--format", "json"]):
        assert wq_cli.main([*argv, "--url", db_url]) == 0, capsys.readouterr().err
        assert str(2**62) in capsys.readouterr().out
    assert wq_sql.compact_queue(name, db_url) >= 2  # epochs 0 and 1 are finished
    wq_sql.reset_queue(name, db_url)
    with WorkQueue.attach(name, url=db_url, worker="after-reset") as wq:
        assert wq.take().epoch == 0
    drop(db_url, name)


# ---------------------------------------------------------------- queue names


@settings(PROPERTY, max_examples=4)
@given(names=st.lists(NAME, min_size=2, max_size=3, unique=True))
@example(names=["Q", "q", "q "])
@example(names=["e\u0301", "\u00e9", "'); DROP TABLE wq_items; --"])
@example(names=['a"b', "a\\b", "a;b"])
def test_queue_names_are_data(db_url: str, bystander: Bystander, names: list[str]) -> None:
    """Names that differ as Python strings are different queues; admin functions given one name
    touch that queue only."""
    try:
        for i, n in enumerate(names):
            with open_queue([f"{i}-a", f"{i}-b"], db_url, name=n, shuffle=False) as wq:
                assert wq.name == n and wq.take() == f"{i}-a"
        listed = {q["name"]: q for q in wq_sql.list_queues(db_url)}
        assert set(listed) == {*names, Bystander.NAME} and all(listed[n]["done"] == 1 for n in names)
        wq_sql.reset_queue(names[0], db_url)
        assert wq_sql.drop_queue(names[1], db_url)
        listed = {q["name"]: q for q in wq_sql.list_queues(db_url)}
        assert set(listed) == {*names, Bystander.NAME} - {names[1]}
        assert listed[names[0]]["done"] == 0 and all(listed[n]["done"] == 1 for n in names[2:])
        with WorkQueue.attach(names[0], url=db_url, worker="tester") as wq:
            assert wq.take() == "0-a"  # reset: epoch 0 again
    finally:
        for n in names:
            drop(db_url, n)
        bystander.check()


def test_admin_functions_refuse_undecodable_names(db_url: str, bystander: Bystander) -> None:
    from wq_sql.admin import create_queue

    for fn in (wq_sql.reset_queue, wq_sql.drop_queue, wq_sql.compact_queue):
        names: tuple[Any, ...] = ("q\udcff", b"q", None)
        for name in names:
            with pytest.raises(InvalidInput, match="name must be"):
                fn(name, db_url)
    with pytest.raises(InvalidInput, match="name must be valid Unicode"):
        create_queue(["a"], name="\ud800", url=db_url)
    assert not wq_sql.drop_queue("x" * 300, db_url)  # a name no queue can have: not found


# ---------------------------------------------------------------- SQL in the data


def test_sql_looking_input_is_stored_verbatim(db_url: str, bystander: Bystander,
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "10")
    name = "'); DROP TABLE wq_items; --"
    worker = "x'); DELETE FROM wq_queues; --"
    error = "'); DROP TABLE wq_events; -- \\ ; \""
    works = ["'); DROP TABLE wq_items; --", "1; DROP TABLE wq_queues", "\\'; --", "%(q)s %s ? :w $1"]
    with open_queue(works, db_url, name=name, worker=worker, prefix="'--", shuffle=False,
                    max_attempts=1) as wq:
        first = wq.take()
        wq.fail(first, error)
        rest, exhausted = take_upto(wq, 10)
    assert exhausted and sorted([first.work, *[r.work for r in rest]]) == sorted(works)
    with bystander.engine.connect() as c:
        failed = c.execute(sa.text("SELECT work, worker, last_error FROM wq_audit WHERE queue = :n AND "
                                   "state = 'failed'"), {"n": name}).one()
        tables = set(sa.inspect(c).get_table_names())
    assert tuple(failed) == (works[0], worker, error)
    assert {"wq_items", "wq_events", "wq_queues", "wq_works", "wq_tallies", "wq_workers"} <= tables
    capsys.readouterr()
    for argv in (["status", name], ["audit", name], ["requeue", name, "--failed"],
                 ["requeue", name, "--worker", worker], ["report", name, "--out", str(tmp_path / "r.html")],
                 ["reset", name, "--yes"], ["drop", name, "--yes"]):
        assert wq_cli.main([*argv, "--url", db_url]) == 0, capsys.readouterr().err
    assert name not in [q["name"] for q in wq_sql.list_queues(db_url)]


# ---------------------------------------------------------------- edge values found by these tests

# Each used to fail late with a raw driver error (or, on SQLite, was silently accepted: with
# lease_seconds=1e12, lease_until was NULL and the claimed item never expired). Now refused.
EDGE_VALUES = [
    pytest.param("lease_seconds", math.inf, "lease_seconds", id="lease_seconds=inf"),
    pytest.param("lease_seconds", 1e300, "lease_seconds", id="lease_seconds=1e300"),
    # SQLite: lease_until beyond year 9999 is NULL, so the claimed item never expires.
    pytest.param("lease_seconds", 1e12, "lease_seconds", id="lease_seconds=1e12"),
    pytest.param("lease_ahead", 2**63, "lease_ahead", id="lease_ahead=2**63"),
    pytest.param("max_attempts", 2**31, "max_attempts", id="max_attempts=2**31"),
    pytest.param("num_slices", 2**31, "num_slices", id="num_slices=2**31"),
    pytest.param("heartbeat_seconds", 0, "heartbeat_seconds", id="heartbeat_seconds=0"),
    pytest.param("heartbeat_seconds", "5", "heartbeat_seconds", id="heartbeat_seconds='5'"),
    pytest.param("heartbeat_seconds", True, "heartbeat_seconds", id="heartbeat_seconds=True"),
    pytest.param("name", "q\udcff", "name", id="name-with-surrogate"),
    pytest.param("prefix", "\udcff/", "prefix", id="prefix-with-surrogate"),
    pytest.param("works", ["a\ud800b"], "works[0]", id="work-with-surrogate"),
]


@pytest.fixture(scope="module", params=BACKENDS)
def shared_db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One database per backend for many small tests that each use their own queue names."""
    yield from fresh_database(request.param, tmp_path_factory.mktemp("shared"), request, "wq", migrated=True)


def _bug_queue(db_url: str, arg: str, value: Any) -> tuple[Any, dict[str, Any]]:
    kw: dict[str, Any] = {"name": unique("bug")}
    if arg != "works":
        kw[arg] = value
    return (value if arg == "works" else ["a", "b"]), kw


@pytest.mark.parametrize(("arg", "value", "needle"), EDGE_VALUES)
def test_edge_values_are_refused_clearly(shared_db_url: str, arg: str, value: Any, needle: str) -> None:
    works, kw = _bug_queue(shared_db_url, arg, value)
    try:
        with pytest.raises(InvalidInput) as info:
            with open_queue(works, shared_db_url, **kw) as wq:
                take_upto(wq, 3)
        assert_clear(info.value, needle)
    finally:
        drop(shared_db_url, kw["name"])


def test_edge_values_do_not_corrupt(db_url: str, bystander: Bystander) -> None:
    """Whatever these inputs do, they never damage another queue or the database file."""
    for case in EDGE_VALUES:
        arg, value, _ = case.values
        works, kw = _bug_queue(db_url, str(arg), value)
        try:
            with open_queue(works, db_url, **kw) as wq:
                take_upto(wq, 3)
        except Exception:
            pass
        finally:
            drop(db_url, kw["name"])
        bystander.check()


def test_admin_create_queue_bounds_integer_columns(db_url: str, bystander: Bystander) -> None:
    """``wq_sql.admin.create_queue`` (``wq-sql create``) refuses what its INTEGER columns cannot
    hold, on both backends, as WorkQueue does."""
    from wq_sql.admin import create_queue

    cases: list[dict[str, Any]] = [{"max_attempts": 2**31}, {"num_slices": 2**31}, {"max_attempts": 2**70}]
    for kw in cases:
        with pytest.raises(InvalidInput, match=rf"{next(iter(kw))} must be .*2\*\*31 - 1"):
            create_queue(["a"], name=unique("adm"), url=db_url, **kw)
    created, row = create_queue(["a"], name=unique("adm"), url=db_url, max_attempts=2**31 - 1,
                                num_slices=2**31 - 1)
    assert created and row.max_attempts == 2**31 - 1
    drop(db_url, row.name)


# ---------------------------------------------------------------- the operator CLI


def run_cli(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``python -m wq_sql argv`` in this process: (exit code, stdout, stderr). An exception that
    escapes ``main`` is what a user would see as a traceback, so it fails the test."""
    try:
        code = wq_cli.main(list(argv))
    except SystemExit as e:  # argparse: usage and one error line, exit 2
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def assert_cli_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code != 0, f"exit 0:\n{out}\n{err}"
    assert "Traceback" not in err + out
    lines = err.strip().splitlines()
    assert lines and re.match(r"^wq-sql( \w+)?: error: ", lines[-1]), err
    if code == 1:  # wq_sql's own errors: exactly one line, nothing on stdout
        assert len(lines) == 1 and out == "", (out, err)
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def _cli_cases(tmp: Path) -> list[tuple[list[str], tuple[str, ...]]]:
    bad_utf8 = tmp / "latin1.txt"
    bad_utf8.write_bytes(b"caf\xe9.txt\n")
    empty = tmp / "empty.txt"
    empty.write_text("# only a comment\n\n")
    return [
        (["create", "q", "--works", "a", "--epochs", "abc"], ("--epochs", "invalid int")),
        (["create", "q", "--works", "a", "--epochs", "0"], ("num_epochs must be a positive int",)),
        (["create", "q", "--works", "a", "--epochs", str(2**70)], ("num_epochs must be at most 2**62",)),
        (["create", "q", "--works", "a", "--seed", "-5"], ("seed must be",)),
        (["create", "q", "--works", "a", "--seed", str(2**63)], ("seed must be",)),
        (["create", "q", "--works", "a", "--max-attempts", "0"], ("max_attempts must be",)),
        (["create", "q", "--works", "a", "--max-attempts", str(2**40)],
         ("max_attempts must be an int from 1 to 2**31 - 1",)),
        (["create", "q", "--works", "a", "--num-slices", "0"], ("num_slices must be",)),
        (["create", "q", "--works", "a", "--num-slices", str(2**40)],
         ("num_slices must be None or an int from 1 to 2**31 - 1",)),
        (["create", "q", "--works", "  "], ("works[0] is empty",)),
        (["create", "x" * 300, "--works", "a"], ("name must be",)),
        (["create", "q\udcff", "--works", "a"], ("NAME is not valid UTF-8",)),
        (["create", "q", "--works", "a\udcff"], ("--works is not valid UTF-8",)),
        (["create", "q", "--works", "a", "--prefix", "\ud800"], ("--prefix is not valid UTF-8",)),
        (["create", "q", "--works-from", str(bad_utf8)], ("not UTF-8 text", "save it as UTF-8")),
        (["create", "q", "--works-from", str(tmp / "missing.txt")], ("cannot read --works-from",)),
        (["create", "q", "--works-from", str(tmp)], ("cannot read --works-from",)),
        (["create", "q", "--works-from", str(empty)], ("lists no works",)),
        (["create", "q", "--works", str(tmp / "*.nothing")], ("matches no file",)),
        (["create", "q"], ("--works",)),
        (["status", "q\udcff"], ("NAME is not valid UTF-8",)),
        (["status", "nope"], ("no queue named 'nope'",)),
        (["status", "nope", "--interval", "0"], ("--interval must be a positive number",)),
        (["status", "nope", "--watch", "--interval", "nan"], ("--interval must be a positive number",)),
        (["status", "nope", "--watch", "--interval", "inf"], ("--interval must be a positive number",)),
        (["status", "nope", "--interval", "-1"], ("--interval must be a positive number",)),
        (["requeue", "nope", "--failed", "--epoch", "-1"], ("--epoch must be",)),
        (["requeue", "nope", "--failed", "--epoch", str(2**70)], ("--epoch must be",)),
        (["requeue", "nope", "--failed", "--epoch", "x"], ("--epoch", "invalid int")),
        (["requeue", "nope", "--failed", "--done"], ("not allowed with",)),
        (["requeue", "nope"], ("one of the arguments",)),
        (["requeue", Bystander.NAME, "--worker", "no'; such --"], ("has no worker named",)),
        (["report", "nope", "--out", str(tmp / "r.txt")], ("write FILE.html",)),
        (["report", "nope", "--out", str(tmp / "no" / "r.html")], ("does not exist",)),
        (["audit", "nope", "--format", "xml"], ("invalid choice",)),
        (["reset", Bystander.NAME], ("without confirmation", "--yes")),
        (["drop", Bystander.NAME], ("without confirmation", "--yes")),
        (["drop", "nope", "--yes"], ("no queue named 'nope'",)),
        (["frobnicate"], ("invalid choice",)),
        ([], ("required",)),
    ]


def test_cli_bad_arguments(db_url: str, bystander: Bystander, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "10")
    capsys.readouterr()
    for argv, needles in _cli_cases(tmp_path):
        full = [*argv, "--url", db_url] if argv and argv[0] != "frobnicate" else argv
        code, out, err = run_cli(full, capsys)
        try:
            assert_cli_error(code, out, err, *needles)
        except AssertionError as e:
            raise AssertionError(f"wq-sql {' '.join(argv)}: {e}") from None
    backend_free = [
        (["ls", "--url", "::not a url::"], ("not a database URL",)),
        (["ls", "--url", "mysql://u@h/db"], ("unsupported database",)),
        (["ls", "--url", "sqlite://"], ("in-memory",)),
        (["ls", "--url", f"sqlite:///{tmp_path / 'no' / 'dir' / 'q.db'}"], ("does not exist",)),
        (["ls", "--url", db_url, "--schema", 'a";b'], ("schema",)),
    ]
    for argv, needles in backend_free:
        assert_cli_error(*run_cli(argv, capsys), *needles)
    assert not list(tmp_path.glob("*.html"))


@pytest.mark.parametrize("backend", ["sqlite"])  # the arguments fail before any database work
def test_cli_bad_arguments_as_a_process(db_url: str, tmp_path: Path) -> None:
    """The real ``python -m wq_sql``, with undecodable bytes in argv: exit code and no traceback."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WQ_SQL_")}, "PYTHONPATH": str(ROOT)}
    for argv, code, needle in (
            ([b"status", b"q\xff", b"--url", db_url.encode()], 1, "NAME is not valid UTF-8"),
            # argparse's own error echoes the argument: stderr escapes it instead of failing.
            ([b"ls", b"x\xff", b"--url", db_url.encode()], 2, "unrecognized arguments"),
            ([b"create", b"q", b"--epochs", b"many", b"--url", db_url.encode()], 2, "invalid int")):
        p = subprocess.run([sys.executable.encode(), b"-m", b"wq_sql", *argv], capture_output=True,
                           timeout=120, env=env, cwd=tmp_path)
        err = p.stderr.decode("utf-8", "replace")
        assert p.returncode == code, (argv, p.returncode, err)
        assert "Traceback" not in err and needle in err, err


CLI_TOKENS = st.one_of(
    st.sampled_from(["--epochs", "--seed", "--max-attempts", "--num-slices", "--prefix", "--works",
                     "--works-from", "--interval", "--epoch", "--worker", "--failed", "--done", "--expired",
                     "--format", "--out", "--yes", "--shuffle", "--no-shuffle", "--sql", "--watch",
                     "json", "csv", "0", "-1", "nan", "inf", "1e999", str(2**63), str(2**31), "3", "",
                     "r.html", "-", "--", "'; DROP TABLE wq_items; --"]),
    st.text(TEXT, max_size=6),
)
BAD_INTERVALS = ("0", "-1", "nan", "inf", "1e999")
COMMANDS = ["upgrade", "current", "ls", "create", "status", "audit", "requeue", "report", "reset", "drop"]


@PROPERTY
@given(command=st.sampled_from(COMMANDS), name=st.one_of(NAME, st.just("fuzzed")),
       tokens=st.lists(CLI_TOKENS, max_size=6))
def test_cli_fuzzed_arguments(db_url: str, bystander: Bystander, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                              command: str, name: str, tokens: list[str]) -> None:
    """Whatever the arguments: exit 0, or an error line without a traceback; the bystander intact.
    (No ``--watch`` without an interval error: it would redraw until the queue is done.)"""
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "10")
    monkeypatch.chdir(tmp_path)
    if not any(a == "--interval" and b in BAD_INTERVALS for a, b in zip(tokens, tokens[1:])):
        tokens = [t for t in tokens if t != "--watch"]
    argv = [command] + ([name] if command not in ("upgrade", "current", "ls") else []) + tokens
    code, out, err = run_cli([*argv, "--url", db_url], capsys)
    try:
        assert code in (0, 1, 2)
        if code:
            assert_cli_error(code, out, err)
    finally:
        drop(db_url, name)
        bystander.check()
