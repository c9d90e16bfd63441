"""The slicing arithmetic and the line-range reader, property-tested (no database)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wq_sql.plan import allocate, cut, slice_name, unslice
from wq_sql.sources import Slice
from wq_sql.sources.lines import LinesSource


@given(st.integers(1, 10_000), st.data())
def test_cut_covers_the_range_exactly_without_empty_ranges(n: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, n))
    ranges = cut(n, k)
    assert len(ranges) == k
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous: no gap, no overlap
    sizes = [e - s for s, e in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n, k", [(0, 1), (5, 0), (5, 6)])
def test_cut_refuses_impossible_requests(n: int, k: int) -> None:
    with pytest.raises(ValueError):
        cut(n, k)


sizes_st = st.lists(st.one_of(st.none(), st.integers(0, 10**9)), min_size=1, max_size=30)


@given(sizes_st, st.one_of(st.none(), st.integers(1, 10_000)))
def test_allocate_totals_and_bounds(sizes: list[Optional[int]], num_slices: Optional[int]) -> None:
    counts = allocate(sizes, num_slices)
    whole = sum(1 for s in sizes if s is None)
    nonempty = sum(1 for s in sizes if s)
    capacity = whole + sum(s for s in sizes if s)
    for s, c in zip(sizes, counts):
        if s is None:
            assert c == 1            # plain works are handed out whole
        elif s == 0:
            assert c == 0            # an empty work yields no item
        else:
            assert 1 <= c <= s       # never an empty slice
    if num_slices is None:
        assert sum(counts) == whole + nonempty
    else:
        assert sum(counts) == min(max(num_slices, whole + nonempty), capacity)


@given(st.lists(st.integers(1, 10**6), min_size=2, max_size=20), st.integers(1, 5_000))
def test_allocate_is_monotone_and_close_to_proportional(sizes: list[int], num_slices: int) -> None:
    counts = allocate(sizes, num_slices)
    for a in range(len(sizes)):
        for b in range(len(sizes)):
            if sizes[a] > sizes[b]:
                assert counts[a] >= counts[b]
            elif sizes[a] == sizes[b]:
                assert abs(counts[a] - counts[b]) <= 1  # a tie for the last place is broken by position
    total = sum(counts)
    if total == num_slices and all(c < s for c, s in zip(counts, sizes)):
        for s, c in zip(sizes, counts):
            quota = num_slices * s / sum(sizes)
            assert c == 1 or abs(c - quota) < 1 + len(sizes)  # min-one shifts at most a few


def test_allocate_examples() -> None:
    assert allocate([100, 300, 600], 10) == [1, 3, 6]
    assert allocate([100, 300, 600], 2) == [1, 1, 1]     # fewer slices than works: one item each
    assert allocate([2, 3], 100) == [2, 3]              # fewer records than slices: one per record
    assert allocate([None, 50, 0], 11) == [1, 10, 0]


def test_slice_names_use_deeprecs_format() -> None:
    assert slice_name("table:t", 5, 9) == "table:t?start=5&end=9"
    # always "?start=" appended to the work as given, even one that holds a "?" of its own
    assert slice_name("table:t?key=a,b", 0, 1) == "table:t?key=a,b?start=0&end=1"
    assert slice_name("lines:/d/what?.txt", 0, 55) == "lines:/d/what?.txt?start=0&end=55"


@given(st.text(), st.integers(0, 2**62), st.integers(0, 2**62))
def test_item_strings_round_trip_whatever_the_work_holds(work: str, start: int, end: int) -> None:
    for w in (work, work + "?start=1&end=2", work + "&start=1&end=2", "lines:x?a=1&b=" + work):
        item = slice_name(w, start, end)
        assert item.endswith(f"?start={start}&end={end}")
        assert unslice(item) == w


def test_items_of_queues_made_before_the_rule_still_unslice() -> None:
    assert unslice("table:t?key=id&start=0&end=10") == "table:t?key=id"
    assert unslice("plain&start=0&end=10") == "plain&start=0&end=10"  # never an item: no "?"


lines_st = st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=60)


@settings(max_examples=200, deadline=None)
@given(lines_st, st.booleans(), st.data())
def test_line_ranges_read_every_line_exactly_once(lines: list[bytes], final_newline: bool,
                                                  data: st.DataObject) -> None:
    content = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.txt"
        path.write_bytes(content)
        src, work = LinesSource(), f"lines:{path}"
        n = src.size(work, None)  # type: ignore[arg-type]
        if n == 0:
            assert src.slices(work, None, 3) == []  # type: ignore[arg-type]
            return
        k = data.draw(st.integers(1, n))
        pieces = src.slices(work, None, k)  # type: ignore[arg-type]
        got = [rec for p in pieces for rec in src.read(work, p, None)]  # type: ignore[arg-type]
    parts = content.split(b"\n")
    # Lines that end with a newline lose a \r before it too (\r\n files); the last part has none.
    expected = [p[:-1] if p.endswith(b"\r") else p for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    assert got == expected


def test_lines_strip_crlf_and_keep_empty_lines(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_bytes(b"a\r\n\r\n\nb")
    src, work = LinesSource(), f"lines:{path}"
    got = [r for p in src.slices(work, None, 4) for r in src.read(work, p, None)]  # type: ignore[arg-type]
    assert got == [b"a", b"", b"", b"b"]


def test_a_line_range_refuses_a_file_that_changed(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_bytes(b"one\ntwo\n")
    src, work = LinesSource(), f"lines:{path}"
    piece = src.slices(work, None, 2)[0]  # type: ignore[arg-type]
    path.write_bytes(b"one\ntwo\nthree\n")
    with pytest.raises(Exception, match="Recreate the queue"):
        list(src.read(work, piece, None))  # type: ignore[arg-type]
    assert isinstance(piece, Slice)
