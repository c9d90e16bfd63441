"""Table keys that are not unique (``?key=day``): the cut and the paging total on the primary key
as a tie-breaker, so every row is read exactly once; a table without a primary key must have a
unique key, checked when the queue is created. Both backends."""

from __future__ import annotations

import collections
import json
from typing import Any, Optional

import pytest
import sqlalchemy as sa

import wq_sql
from wq_sql import InvalidInput, WorkQueue

N = 2500  # more than two pages of 1,000 rows: each run of equal days crosses a page and a cut
DAYS = ("2026-01-01", "2026-01-02", "2026-01-03")


def make_visits(url: str, name: str = "visits", *, pk: bool = True, unique: Optional[tuple[str, ...]] = None,
                rows: Optional[list[tuple[int, str, int]]] = None) -> None:
    """``name(id, day, grp)``: ``day`` takes 3 values, spread over the ids so that neither the
    ids nor the insertion order follow the days."""
    engine = sa.create_engine(wq_sql.engine.resolve_url(url))
    md = sa.MetaData()
    extra = [sa.UniqueConstraint(*unique)] if unique else []
    table = sa.Table(name, md, sa.Column("id", sa.Integer, primary_key=pk), sa.Column("day", sa.Text),
                     sa.Column("grp", sa.Integer), *extra)
    md.create_all(engine)
    if rows is None:
        rows = [(i, DAYS[(i * 7) % 3], i % 5) for i in range(N)]
    with engine.begin() as c:
        c.execute(sa.insert(table), [{"id": i, "day": d, "grp": g} for i, d, g in rows])
    engine.dispose()


def read_ids(wq: WorkQueue) -> collections.Counter[int]:
    """The multiset of ids read, item by item (``id`` is the first column)."""
    return collections.Counter(r[0] for item in wq for r in wq.read(item, columns=["id", "day"]))


def stored_bounds(url: str) -> list[dict[str, Any]]:
    engine = sa.create_engine(wq_sql.engine.resolve_url(url))
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT bounds FROM wq_works ORDER BY idx")).scalars().all()
    engine.dispose()
    return [json.loads(b)["bounds"] for b in rows]


@pytest.mark.parametrize("num_slices", [1, 2, 7])
def test_a_key_with_long_runs_of_equal_values_reads_every_row_once(db_url: str, num_slices: int) -> None:
    make_visits(db_url)
    with WorkQueue(["table:visits?key=day"], num_slices=num_slices, shuffle=False, url=db_url) as wq:
        assert wq.items_per_epoch == num_slices  # cuts inside a run of equal days do not merge
        got = read_ids(wq)
    assert got == collections.Counter(range(N))
    assert {tuple(b["key"]) for b in stored_bounds(db_url)} == {("day", "id")}  # the key actually used


def test_a_composite_key_that_is_not_unique_gets_the_tie_breaker(db_url: str) -> None:
    make_visits(db_url)
    with WorkQueue(["table:visits?key=grp,day"], num_slices=6, url=db_url) as wq:
        got = read_ids(wq)
    assert got == collections.Counter(range(N))
    assert {tuple(b["key"]) for b in stored_bounds(db_url)} == {("grp", "day", "id")}


def test_small_pages_read_every_row_once(db_url: str) -> None:
    make_visits(db_url)
    with WorkQueue(["table:visits?key=day"], num_slices=3, url=db_url) as wq:
        got = collections.Counter(r[0] for item in wq for r in wq.read(item, columns=["id"], page_rows=7))
    assert got == collections.Counter(range(N))


@pytest.mark.parametrize("key, unique, stored", [
    ("id", None, ("id",)),                  # the primary key
    ("id,day", None, ("id", "day")),        # contains the primary key
    ("day,grp", ("day", "grp"), ("day", "grp")),  # exactly a unique constraint
])
def test_keys_known_to_be_unique_are_used_as_given(db_url: str, key: str, unique: Optional[tuple[str, ...]],
                                                   stored: tuple[str, ...]) -> None:
    rows = [(i, DAYS[i % 3], i // 3) for i in range(300)]  # (day, grp) is unique
    make_visits(db_url, unique=unique, rows=rows)
    with WorkQueue([f"table:visits?key={key}"], num_slices=4, url=db_url) as wq:
        got = read_ids(wq)
    assert got == collections.Counter(range(300))
    assert {tuple(b["key"]) for b in stored_bounds(db_url)} == {stored}


def test_without_a_primary_key_a_repeated_key_is_refused(db_url: str) -> None:
    make_visits(db_url, "loose", pk=False)
    with pytest.raises(InvalidInput, match=r"not unique.*add a unique column as tie-breaker: "
                                           r"table:loose\?key=day,<unique column>"):
        WorkQueue(["table:loose?key=day"], num_slices=3, url=db_url)
    with pytest.raises(InvalidInput, match="not unique"):
        WorkQueue(["table:loose?key=day,grp"], url=db_url)
    assert wq_sql.list_queues(db_url) == []
    # a unique key works without a primary key, and is used as given
    with WorkQueue(["table:loose?key=id"], num_slices=7, url=db_url) as wq:
        got = read_ids(wq)
    assert got == collections.Counter(range(N))
    assert {tuple(b["key"]) for b in stored_bounds(db_url)} == {("id",)}


def test_bounds_stored_before_the_tie_breaker_still_read_every_row(db_url: str) -> None:
    """Queues created before the tie-breaker stored the key as given: their items are key ranges
    of that key alone (equal keys never split), and reading them pages with the tie-breaker."""
    make_visits(db_url)
    with WorkQueue(["table:visits?key=day"], num_slices=2, shuffle=False, url=db_url) as wq:
        old = [{"key": ["day"], "lo": [DAYS[0]], "hi": [DAYS[1]], "hi_inclusive": False},
               {"key": ["day"], "lo": [DAYS[1]], "hi": [DAYS[2]], "hi_inclusive": True}]
        engine = sa.create_engine(wq_sql.engine.resolve_url(db_url))
        with engine.begin() as c:
            for idx, b in enumerate(old):
                full = json.loads(c.execute(sa.text("SELECT bounds FROM wq_works WHERE idx = :i"),
                                            {"i": idx}).scalar_one())
                full["bounds"] = b
                c.execute(sa.text("UPDATE wq_works SET bounds = :b WHERE idx = :i"),
                          {"b": json.dumps(full, sort_keys=True), "i": idx})
        engine.dispose()
        got = read_ids(wq)
    assert got == collections.Counter(range(N))
