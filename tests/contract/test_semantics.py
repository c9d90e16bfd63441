"""Single-process semantics of ``WorkQueue``, on both backends.

Everything here runs in one process; several workers are several ``WorkQueue`` objects with
different ``worker=`` names. What the queue did is checked through the documented SQL surface
(``wq_audit``, ``wq_history``), not through private attributes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

import wq_sql
from wq_sql import (
    InvalidInput,
    Progress,
    QueueConfigMismatch,
    QueueEmpty,
    QueueExhausted,
    QueueNotFound,
    WorkQueue,
)
from wq_sql.plan import epoch_order
from wq_sql.store.engine import resolve_url

WORKS = ["to", "be", "or", "not", "to", "be"]
AUDIT_COLUMNS = ["queue", "epoch", "seq", "work", "worker", "state", "attempts", "claimed_at",
                 "done_at", "last_error", "item_id", "source"]


# ---------------------------------------------------------------- helpers


def query(url: str, sql: str, **params: Any) -> list[Any]:
    """Rows of ``sql`` read through a throwaway connection (what an auditor would do)."""
    engine = sa.create_engine(resolve_url(url), poolclass=NullPool)
    try:
        with engine.connect() as c:
            return list(c.execute(sa.text(sql), params))
    finally:
        engine.dispose()


def audit(url: str, queue: str) -> list[Any]:
    return query(url, "SELECT * FROM wq_audit WHERE queue = :q ORDER BY epoch, seq", q=queue)


def drain(wq: WorkQueue) -> list[str]:
    return [str(item) for item in wq]


@pytest.fixture
def second_db_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """Another fresh, migrated database of the same backend as ``db_url``."""
    from backends import fresh_database

    yield from fresh_database(backend, tmp_path, request, "second", migrated=True)

# ---------------------------------------------------------------- joining and configuration


@pytest.mark.parametrize("change, needle", [
    ({"works": ["to", "be", "or", "not", "to", "BE"]},
     "works differ at works[5]: stored 'be', given 'BE' (6 works stored, 6 given)"),
    ({"works": WORKS[:-1]}, "works differ: works[5] is stored as 'be', not given (6 works stored, 5 given)"),
    ({"works": WORKS + ["x"]},
     "works differ: works[6] is given as 'x', not stored (6 works stored, 7 given)"),
    ({"max_attempts": 5}, "max_attempts: stored 3, given 5"),
    ({"num_epochs": 3}, "num_epochs: stored 2, given 3"),
    ({"shuffle": False}, "shuffle: stored True, given False"),
    ({"num_slices": 4}, "num_slices: stored None, given 4"),
    ({"seed": 8}, "seed: stored 7, given 8"),
])
def test_config_mismatch_says_what_differs_and_how_to_start_over(
        db_url: str, change: dict[str, Any], needle: str) -> None:
    config: dict[str, Any] = {"works": WORKS, "num_epochs": 2, "shuffle": True, "seed": 7,
                              "num_slices": None, "name": "q"}
    with WorkQueue(**config, url=db_url, worker="creator"):
        before = audit(db_url, "q")
        with pytest.raises(QueueConfigMismatch) as ei:
            WorkQueue(**{**config, **change}, url=db_url, worker="joiner")
        assert audit(db_url, "q") == before  # the failed join changed nothing
    msg = str(ei.value)
    assert needle in msg
    assert ei.value.queue == "q" and len(ei.value.differences) == 1
    # ... and how to start over: another name, or an explicit reset.
    assert "name=" in msg and "reset" in msg
    stored = query(db_url, "SELECT num_epochs, seed, shuffle FROM wq_queues WHERE name = 'q'")[0]
    assert tuple(stored) == (2, 7, True)


def test_works_mismatch_reads_stored_works_in_chunks_up_to_the_first_difference(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from wq_sql.store.engine import make_engine
    from wq_sql.worker import joining

    monkeypatch.setattr(joining, "WORKS_CHUNK", 7)
    works = [f"w{i}" for i in range(30)]
    engine = make_engine(resolve_url(db_url))
    reads: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "wq_works.bounds" in statement and "ORDER BY wq_works.idx" in statement:
            reads.append(statement)

    def join(given: list[str]) -> tuple[str, int]:
        reads.clear()
        with pytest.raises(QueueConfigMismatch) as ei:
            WorkQueue(given, shuffle=False, name="q", worker="b", engine=engine)
        assert len(ei.value.differences) == 1
        return ei.value.differences[0], len(reads)

    try:
        with WorkQueue(works, shuffle=False, name="q", worker="a", engine=engine):
            reads.clear()
            with WorkQueue(works, shuffle=False, name="q", worker="same", engine=engine):
                assert reads == []  # equal digests: the works are not read
            assert join(works[:3] + ["x"] + works[4:]) == (
                "works differ at works[3]: stored 'w3', given 'x' (30 works stored, 30 given)", 1)
            assert join(works[:20] + ["x"] + works[21:]) == (
                "works differ at works[20]: stored 'w20', given 'x' (30 works stored, 30 given)", 3)
            assert join(works + ["w30"]) == (
                "works differ: works[30] is given as 'w30', not stored (30 works stored, 31 given)", 5)
            assert join(works[:14]) == (
                "works differ: works[14] is stored as 'w14', not given (30 works stored, 14 given)", 3)
            # A long value is shown cut.
            msg, _ = join(works[:2] + ["y" * 1_000_000] + works[3:])
            assert "given 'yyyyy" in msg and "... (1000000 characters)" in msg and len(msg) < 300
    finally:
        engine.dispose()


def test_works_mismatch_of_sliced_works_names_the_work_as_given(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.txt").write_text("".join(f"{name} line {i}\n" for i in range(50)))
    works = ["lines:a.txt", "lines:b.txt", "lines:a.txt"]  # a repeated work is its own works[i]
    with WorkQueue(works, num_slices=9, name="q", url=db_url, worker="a") as wq:
        assert wq.items_per_epoch == 9
        for given, needle in [
            (["lines:a.txt", "lines:b.txt", "lines:c.txt"],
             "works differ at works[2]: stored 'lines:a.txt', given 'lines:c.txt' "
             "(9 items stored (num_slices=9), 3 works given)"),
            (works[:2], "works differ: works[2] is stored as 'lines:a.txt', not given"),
            (works + ["lines:c.txt"], "works differ: works[3] is given as 'lines:c.txt', not stored"),
        ]:
            with pytest.raises(QueueConfigMismatch) as ei:
                WorkQueue(given, num_slices=9, name="q", url=db_url, worker="b")
            assert ei.value.differences[0].startswith(needle), ei.value.differences


def test_max_attempts_is_the_stored_one_unless_given_and_then_must_match(db_url: str) -> None:
    with WorkQueue(WORKS, name="q", url=db_url, worker="a", max_attempts=2) as a:
        assert a.max_attempts == 2
        with WorkQueue(WORKS, name="q", url=db_url, worker="b") as b:
            assert b.max_attempts == 2  # not given: the stored value
        with WorkQueue(WORKS, name="q", url=db_url, worker="c", max_attempts=2) as c:
            assert c.max_attempts == 2
        with pytest.raises(QueueConfigMismatch, match=r"max_attempts: stored 2, given 3\."):
            WorkQueue(WORKS, name="q", url=db_url, worker="d", max_attempts=3)
        with pytest.raises(QueueConfigMismatch, match="max_attempts: stored 2, given 5"):
            WorkQueue.attach("q", url=db_url, worker="e", max_attempts=5)
    with WorkQueue(WORKS, name="default", url=db_url, worker="a") as d:
        assert d.max_attempts == 3
    assert [r[0] for r in query(db_url, "SELECT max_attempts FROM wq_queues ORDER BY name")] == [3, 2]


def test_mismatch_on_num_epochs_names_the_extend_command(db_url: str) -> None:
    with WorkQueue(WORKS, num_epochs=2, name="my q", url=db_url, worker="a"):
        with pytest.raises(QueueConfigMismatch) as ei:
            WorkQueue(WORKS, num_epochs=5, name="my q", url=db_url, worker="b")
        assert "`python -m wq_sql extend 'my q' --epochs 5`" in str(ei.value)
        assert "wq.extend_epochs(5)" in str(ei.value) and ei.value.extend_to == 5
        with pytest.raises(QueueConfigMismatch) as ei:
            WorkQueue(WORKS, num_epochs=1, name="my q", url=db_url, worker="b")
        assert "extend" not in str(ei.value) and ei.value.extend_to is None


def test_config_mismatch_lists_every_difference(db_url: str) -> None:
    with WorkQueue(WORKS, num_epochs=2, seed=7, name="q", url=db_url, worker="a"):
        with pytest.raises(QueueConfigMismatch) as ei:
            WorkQueue(WORKS, num_epochs=3, shuffle=False, seed=9, name="q", url=db_url, worker="b")
    assert len(ei.value.differences) == 3
    assert all(s in str(ei.value) for s in ("num_epochs", "shuffle", "seed"))


def test_same_config_joins_and_normalised_works_compare_equal(db_url: str) -> None:
    with WorkQueue(WORKS, num_epochs=2, seed=7, name="q", url=db_url, worker="a") as a:
        # bytes and surrounding white space normalise to the same works: same digest.
        joined = [f"  {w}\n".encode() for w in WORKS]
        with WorkQueue(joined, num_epochs=2, seed=7, name="q", url=db_url, worker="b") as b:
            assert (b.seed, b.num_epochs, b.items_per_epoch) == (7, 2, len(WORKS))
            assert a.take() in WORKS and b.take() in WORKS


def test_seed_none_joins_any_stored_seed(db_url: str) -> None:
    with WorkQueue(WORKS, num_epochs=2, seed=12345, name="q", url=db_url, worker="a") as a:
        with WorkQueue(WORKS, num_epochs=2, seed=None, name="q", url=db_url, worker="b") as b:
            assert b.seed == a.seed == 12345
    # A queue created with seed=None stores a generated seed that later joiners adopt.
    with WorkQueue(WORKS, num_epochs=1, name="gen", url=db_url, worker="a") as c:
        assert isinstance(c.seed, int)
        stored = query(db_url, "SELECT seed FROM wq_queues WHERE name = 'gen'")[0][0]
        assert stored == c.seed
        with WorkQueue(WORKS, num_epochs=1, name="gen", url=db_url, worker="b") as d:
            assert d.seed == c.seed
        # ... and an explicit seed equal to the generated one is the same configuration.
        with WorkQueue(WORKS, num_epochs=1, seed=c.seed, name="gen", url=db_url, worker="e"):
            pass


def test_changed_prefix_is_allowed_and_concatenated_plainly(db_url: str) -> None:
    files = ["a.txt", "b.txt", "c.txt"]
    with WorkQueue(files, shuffle=False, prefix="/old/", name="q", url=db_url, worker="a") as a:
        assert a.take() == "/old/a.txt"
        # The data moved: a joiner with another prefix is welcome and sees its own prefix.
        with WorkQueue(files, shuffle=False, prefix="s3://bucket", name="q", url=db_url,
                       worker="b") as b:
            item = b.take()
            assert item == "s3://bucketb.txt"  # plain concatenation, no separator added
            assert item.work == "b.txt"
        # b.txt was completed by b's close; the stored work carries no prefix.
    rows = audit(db_url, "q")
    assert [r.work for r in rows] == files
    assert all(not r.work.startswith(("/old/", "s3:")) for r in rows)


def test_attach_uses_the_stored_prefix_and_config(db_url: str) -> None:
    with WorkQueue(["x", "y"], num_epochs=3, shuffle=False, prefix="p/", name="q", url=db_url,
                   worker="a"):
        with WorkQueue.attach("q", url=db_url, worker="b") as b:
            assert (b.num_epochs, b.items_per_epoch, b.shuffle, b.prefix) == (3, 2, False, "p/")
            assert b.take() == "p/x"


def test_attach_unknown_name_raises_queue_not_found(db_url: str) -> None:
    with WorkQueue(WORKS, name="exists", url=db_url, worker="a"):
        pass
    with pytest.raises(QueueNotFound, match="'nope'"):
        WorkQueue.attach("nope", url=db_url, worker="b")


def test_attach_drains_what_the_creator_left(db_url: str) -> None:
    with WorkQueue(WORKS, num_epochs=2, shuffle=False, name="q", url=db_url, worker="a") as a:
        first = [a.take() for _ in range(3)]
    with WorkQueue.attach("q", url=db_url, worker="b") as b:
        rest = drain(b)
    assert first + rest == WORKS * 2


def test_extend_epochs(db_url: str) -> None:
    with WorkQueue(["a", "b"], num_epochs=1, shuffle=False, name="q", url=db_url, worker="w") as wq:
        assert drain(wq) == ["a", "b"]
        wq.extend_epochs(3)
        assert wq.num_epochs == 3 and wq.progress().total == 6
        assert drain(wq) == ["a", "b"] * 2
        with pytest.raises(InvalidInput, match="only grow"):
            wq.extend_epochs(2)
        with pytest.raises(InvalidInput):
            wq.extend_epochs(0)
    assert [(r.epoch, r.state) for r in audit(db_url, "q")] == [(e, "done") for e in range(3) for _ in "ab"]
    # Joiners must now say num_epochs=3: the old configuration is a mismatch, the new one joins.
    with pytest.raises(QueueConfigMismatch, match="num_epochs: stored 3, given 1"):
        WorkQueue(["a", "b"], num_epochs=1, shuffle=False, name="q", url=db_url, worker="x")
    with WorkQueue(["a", "b"], num_epochs=3, shuffle=False, name="q", url=db_url, worker="y") as wq:
        assert wq.progress().done == 6
        with pytest.raises(QueueExhausted):
            wq.take()


def test_extend_epochs_while_running_keeps_order(db_url: str) -> None:
    with WorkQueue(["a", "b", "c"], num_epochs=1, shuffle=False, name="q", url=db_url,
                   worker="w") as wq:
        got = [wq.take()]
        wq.extend_epochs(2)
        got += drain(wq)
    assert got == ["a", "b", "c"] * 2


def test_joining_a_finished_queue_warns(db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    with WorkQueue(["a"], name="q", url=db_url, worker="a") as wq:
        drain(wq)
    with caplog.at_level("WARNING", logger="wq_sql"):
        with WorkQueue(["a"], name="q", url=db_url, worker="b") as wq:
            with pytest.raises(QueueExhausted):
                wq.take()
    assert any("already finished" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- works as data


def test_duplicate_works_are_distinct_items(db_url: str) -> None:
    with WorkQueue(WORKS, num_epochs=1, shuffle=True, seed=3, name="q", url=db_url, worker="w") as wq:
        assert wq.items_per_epoch == 6 and wq.progress().total == 6
        items = list(wq)
    assert Counter(items) == Counter(WORKS)
    assert len({(i.epoch, i.seq) for i in items}) == 6
    rows = audit(db_url, "q")
    assert len(rows) == 6 and {r.state for r in rows} == {"done"}
    assert Counter(r.work for r in rows) == Counter(WORKS)


def test_duplicate_works_are_completed_individually(db_url: str) -> None:
    """Completing one "to" must not complete the other "to"."""
    with WorkQueue(["to", "to"], shuffle=False, auto_complete=False, name="q", url=db_url,
                   worker="w") as wq:
        first, second = wq.take(), wq.take()
        assert first == second == "to" and first.seq != second.seq
        wq.complete(second)
        assert [r.state for r in audit(db_url, "q")] == ["claimed", "done"]
        wq.complete(first)
    assert [r.state for r in audit(db_url, "q")] == ["done", "done"]


def test_bytes_works_are_decoded(db_url: str) -> None:
    works = [b"a.txt", "b.txt", "caf\u00e9.txt".encode()]
    with WorkQueue(works, shuffle=False, prefix=b"/data/", name="q", url=db_url, worker="w") as wq:
        got = list(wq)
    assert got == ["/data/a.txt", "/data/b.txt", "/data/caf\u00e9.txt"]
    assert all(type(g) is not bytes and isinstance(g, str) for g in got)
    assert [r.work for r in audit(db_url, "q")] == ["a.txt", "b.txt", "caf\u00e9.txt"]


def test_invalid_utf8_bytes_give_a_clear_error(db_url: str) -> None:
    with pytest.raises(InvalidInput, match=r"works\[1\] is not valid UTF-8"):
        WorkQueue([b"ok", b"\xff\xfe"], url=db_url, worker="w")


def test_unicode_and_long_works_round_trip(db_url: str) -> None:
    long_work = "hdfs://cluster/" + "x" * 100_000 + "/part-0.gz"
    works = ["\u65e5\u672c\u8a9e/\u30c7\u30fc\u30bf.txt", "\u0444\u0430\u0439\u043b.csv",
             "\U0001f600 emoji \U0001f680", "tab\tinside", "line\nbreak inside", long_work,
             "\u00e9\u0301 combining", "\u200b zero width"]
    with WorkQueue(works, shuffle=False, name="q", url=db_url, worker="w") as wq:
        got = list(wq)
    assert got == works
    assert [r.work for r in audit(db_url, "q")] == works
    # The digest round-trips too: the same works join.
    with WorkQueue(works, shuffle=False, name="q", url=db_url, worker="v"):
        pass


def test_num_slices_leaves_file_paths_whole(db_url: str) -> None:
    """DeepRec's test_slices: num_slices is invalid when reading files."""
    files = ["/data/part-0.txt", "/data/part-1.txt", "/data/part-2.txt"]
    with WorkQueue(files, num_epochs=2, shuffle=False, num_slices=10, name="q", url=db_url,
                   worker="w") as wq:
        assert wq.num_slices == 10 and wq.items_per_epoch == 3
        assert list(wq) == files * 2
    # num_slices is part of the configuration even when it does not slice.
    with pytest.raises(QueueConfigMismatch, match="num_slices"):
        WorkQueue(files, num_epochs=2, shuffle=False, name="q", url=db_url, worker="v")


@pytest.mark.parametrize("num_slices", [0, -2, 1.5, "3", True])
def test_bad_num_slices(db_url: str, num_slices: Any) -> None:
    with pytest.raises(InvalidInput, match="num_slices"):
        WorkQueue(WORKS, num_slices=num_slices, url=db_url, worker="w")


# ---------------------------------------------------------------- epochs and order


def test_a_million_epochs_leave_at_most_two_epochs_of_rows(db_url: str) -> None:
    works = [f"f{i}" for i in range(5)]
    # One item per round, none ahead (a round of the automatic size may span several 5-item
    # epochs, each of which then has rows: the bound is two epochs beyond what was claimed).
    with WorkQueue(works, num_epochs=10**6, seed=1, name="q", url=db_url, worker="w", lease_ahead=1,
                   claim_ahead=False) as wq:
        assert wq.progress().total == 5 * 10**6
        rows = query(db_url, "SELECT epoch, count(*) FROM wq_items GROUP BY epoch ORDER BY epoch")
        assert len(rows) <= 2 and rows[0] == (0, 5)
        for n_taken in range(1, 13):
            wq.take()
            # Epochs with rows not yet handed out (pending or claimed ahead): at most two, and
            # every epoch with rows is either fully handed out or one of those two.
            open_epochs = query(db_url, "SELECT DISTINCT epoch FROM wq_items "
                                        "WHERE state IN ('pending', 'claimed') ORDER BY epoch")
            assert len(open_epochs) <= 2, (n_taken, open_epochs)
            created = query(db_url, "SELECT count(DISTINCT epoch), count(*) FROM wq_items")[0]
            assert created[0] <= n_taken // 5 + 2, (n_taken, created)
            assert created[1] == created[0] * 5
        assert wq.progress().epochs_created <= 4


def test_epochs_never_interleave_with_shuffle(db_url: str) -> None:
    works = [f"w{i:02d}" for i in range(7)]
    n_epochs = 4
    # No claim-ahead: every round runs in this thread, one after the other. Concurrent rounds
    # under SKIP LOCKED may stamp out of lock order (a round that started first can lock the
    # next epoch's rows, skipping those another round just locked), which time cannot order.
    with WorkQueue(works, num_epochs=n_epochs, shuffle=True, seed=99, name="q", url=db_url,
                   worker="a", lease_ahead=3, claim_ahead=False) as a, \
         WorkQueue(works, num_epochs=n_epochs, shuffle=True, seed=99, name="q", url=db_url,
                   worker="b", lease_ahead=2, claim_ahead=False) as b:
        got: dict[str, list[Any]] = {"a": [], "b": []}
        live = {"a": a, "b": b}
        turn = 0
        while live:
            name = sorted(live)[turn % len(live)]
            turn += 1
            try:
                # Never wait: the other worker of this thread may hold the last items ahead.
                got[name].append(live[name].take(timeout=0))
            except QueueEmpty:
                pass
            except QueueExhausted:
                del live[name]
    # Each worker sees epochs in order...
    for items in got.values():
        assert [i.epoch for i in items] == sorted(i.epoch for i in items)
    # ... and globally every item of epoch e was claimed before any of epoch e+1: the claims, in
    # the order they were made, go strictly up in (epoch, seq). wq_history makes its claim rows
    # from the rows that end deliveries, so across items their time orders them, not event_id;
    # the claims of one round share it (Postgres: since migration 0008; SQLite: one statement).
    claims = [(r.epoch, r.seq) for r in query(
        db_url, "SELECT epoch, seq FROM wq_history WHERE queue = 'q' AND kind = 'claim' "
                "ORDER BY at, epoch, seq")]
    assert claims == sorted(claims) and len(claims) == len(set(claims)) == len(works) * n_epochs
    # Each epoch is a permutation of the works, and exactly the one plan.epoch_order promises.
    everything = got["a"] + got["b"]
    assert len(everything) == len(works) * n_epochs
    for e in range(n_epochs):
        by_seq = sorted((i for i in everything if i.epoch == e), key=lambda i: i.seq)
        assert [i.work for i in by_seq] == [works[k] for k in epoch_order(len(works), e, True, 99)]


def test_shuffle_is_identical_across_databases_and_differs_per_epoch(
        db_url: str, second_db_url: str) -> None:
    works = [f"part-{i:03d}" for i in range(20)]
    runs = []
    for url in (db_url, second_db_url):
        with WorkQueue(works, num_epochs=3, shuffle=True, seed=2024, name="q", url=url, worker="w") as wq:
            runs.append(drain(wq))
    assert runs[0] == runs[1]
    epochs = [runs[0][i * 20:(i + 1) * 20] for i in range(3)]
    assert all(sorted(e) == works for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3
    assert epochs[0] != works
    # Another seed gives another order.
    with WorkQueue(works, num_epochs=1, shuffle=True, seed=2025, name="other", url=db_url,
                   worker="w") as wq:
        assert drain(wq) != epochs[0]


def test_shuffle_false_gives_works_times_epochs_in_order(db_url: str) -> None:
    with WorkQueue(WORKS, num_epochs=3, shuffle=False, name="q", url=db_url, worker="w",
                   lease_ahead=4) as wq:
        assert drain(wq) == WORKS * 3


# ---------------------------------------------------------------- release, fail, attempts


def test_release_does_not_count_an_attempt(db_url: str) -> None:
    # One item per round, none ahead: the released item is the next one claimed (a worker that
    # claimed ahead hands out what it already holds first).
    with WorkQueue(["a", "b"], shuffle=False, name="q", url=db_url, worker="w", lease_ahead=1,
                   claim_ahead=False) as wq:
        for _ in range(5):
            item = wq.take()
            assert item == "a"
            wq.release(item)
        row = audit(db_url, "q")[0]
        assert (row.state, row.attempts, row.last_error) == ("pending", 0, None)
        assert drain(wq) == ["a", "b"]
    assert [(r.state, r.attempts) for r in audit(db_url, "q")] == [("done", 0), ("done", 0)]
    kinds = [r.kind for r in query(db_url, "SELECT kind FROM wq_history WHERE seq = 0 ORDER BY event_id")]
    assert kinds == ["claim", "release"] * 5 + ["claim", "done"]


def test_fail_counts_attempts_until_failed(db_url: str) -> None:
    with WorkQueue(["bad", "good"], shuffle=False, max_attempts=3, name="q", url=db_url,
                   worker="w", lease_ahead=1, claim_ahead=False) as wq:  # the failed item comes next
        for attempt in range(1, 4):
            item = wq.take()
            assert item == "bad" and item.attempts == attempt - 1
            wq.fail(item, ValueError(f"corrupt record, try {attempt}"))
            row = audit(db_url, "q")[0]
            assert row.attempts == attempt
            assert row.state == ("failed" if attempt == 3 else "pending")
        assert wq.take() == "good"
        with pytest.raises(QueueExhausted) as ei:
            wq.take()
        assert ei.value.failed == 1 and ei.value.done == 1
        assert "failed" in str(ei.value) and "wq_audit" in str(ei.value)
        p = wq.progress()
        assert (p.done, p.failed, p.remaining) == (1, 1, 0)
    bad = query(db_url, "SELECT * FROM wq_audit WHERE queue = 'q' AND state = 'failed'")
    assert len(bad) == 1
    assert (bad[0].work, bad[0].attempts, bad[0].worker) == ("bad", 3, "w")
    assert bad[0].last_error == "corrupt record, try 3" and bad[0].done_at is not None
    fails = query(db_url, "SELECT detail FROM wq_history WHERE kind = 'fail' ORDER BY event_id")
    assert [f.detail for f in fails] == [f"corrupt record, try {i}" for i in (1, 2, 3)]


def test_failed_items_of_several_epochs_are_counted(db_url: str) -> None:
    with WorkQueue(["a", "b"], num_epochs=2, shuffle=False, max_attempts=1, name="q", url=db_url,
                   worker="w", auto_complete=False) as wq:
        for item in wq:
            if item == "a":
                wq.fail(item, "no")
            else:
                wq.complete(item)
        with pytest.raises(QueueExhausted) as ei:
            wq.take()
    assert (ei.value.done, ei.value.failed) == (2, 2)


def test_take_timeout_zero_raises_queue_empty_while_another_worker_holds_the_last_item(
        db_url: str) -> None:
    with WorkQueue(["only"], name="q", url=db_url, worker="holder") as holder, \
         WorkQueue(["only"], name="q", url=db_url, worker="waiter") as waiter:
        item = holder.take()
        with pytest.raises(QueueEmpty, match="other workers"):
            waiter.take(timeout=0)
        with pytest.raises(QueueEmpty):
            waiter.take(timeout=0.2)
        # Released, it is claimable again; then the end is seen by both.
        holder.release(item)
        again = waiter.take(timeout=0)
        assert again == "only"
        with pytest.raises(QueueEmpty):
            holder.take(timeout=0)
        waiter.complete(again)
        with pytest.raises(QueueExhausted):
            holder.take(timeout=0)
        with pytest.raises(QueueExhausted):
            waiter.take(timeout=0)


def test_complete_twice_or_a_foreign_string_is_a_clear_error(db_url: str) -> None:
    with WorkQueue(["a", "b", "c"], shuffle=False, auto_complete=False, name="q", url=db_url,
                   worker="w") as wq, \
         WorkQueue(["a", "b", "c"], shuffle=False, auto_complete=False, name="q", url=db_url,
                   worker="v") as other:
        a = wq.take()
        wq.complete(a)
        with pytest.raises(InvalidInput, match="already completed"):
            wq.complete(a)
        with pytest.raises(InvalidInput, match="already"):
            wq.release(a)
        with pytest.raises(InvalidInput, match="pass what take\\(\\) returned"):
            wq.complete("not-a-work")
        # A plain str equal to a held item is accepted (DeepRec code passes strings around).
        b = wq.take()
        wq.complete(str(b))
        with pytest.raises(InvalidInput):
            wq.complete("b")
        # Another queue object's item is not ours.
        c = other.take()
        with pytest.raises(InvalidInput, match="not an item this queue object holds"):
            wq.complete(c)
        other.complete(c)
    assert [r.state for r in audit(db_url, "q")] == ["done", "done", "done"]


def test_complete_after_close_is_an_error(db_url: str) -> None:
    wq = WorkQueue(["a", "b"], name="q", url=db_url, worker="w")
    item = wq.take()
    wq.close()
    with pytest.raises(wq_sql.WqSqlError, match="closed"):
        wq.complete(item)
    with pytest.raises(wq_sql.WqSqlError, match="closed"):
        wq.take()
    wq.close()  # idempotent


# ---------------------------------------------------------------- claiming ahead and closing


def test_lease_ahead_claims_ahead_and_close_gives_them_back(db_url: str) -> None:
    works = [f"w{i}" for i in range(6)]
    with WorkQueue(works, shuffle=False, lease_ahead=3, name="q", url=db_url, worker="w") as wq:
        first = wq.take()
        assert first == "w0"
        states = [(r.work, r.state, r.worker) for r in audit(db_url, "q")]
        assert states[:3] == [("w0", "claimed", "w"), ("w1", "claimed", "w"), ("w2", "claimed", "w")]
        assert all(s == "pending" for _, s, _ in states[3:])
        # Another worker gets what is not claimed ahead.
        with WorkQueue(works, shuffle=False, name="q", url=db_url, worker="v") as other:
            assert other.take() == "w3"
        # The next two come from the local buffer, without a round trip.
        assert [wq.take(), wq.take()] == ["w1", "w2"]
        wq.take()  # a fresh claim of up to 3: w4, w5
    rows = audit(db_url, "q")
    # Closing acked the handed-out item and gave back what was claimed ahead, without an attempt.
    assert [(r.work, r.state, r.attempts) for r in rows] == [
        ("w0", "done", 0), ("w1", "done", 0), ("w2", "done", 0), ("w3", "done", 0),
        ("w4", "done", 0), ("w5", "pending", 0)]
    assert rows[5].worker == "w"  # the last holder stays visible
    release = query(db_url, "SELECT seq, kind FROM wq_history WHERE kind = 'release'")
    assert [(r.seq, r.kind) for r in release] == [(5, "release")]


def test_close_without_auto_complete_gives_everything_back(db_url: str) -> None:
    with WorkQueue(["a", "b", "c"], shuffle=False, lease_ahead=2, auto_complete=False, name="q",
                   url=db_url, worker="w") as wq:
        wq.take()
    assert [(r.state, r.attempts) for r in audit(db_url, "q")] == [("pending", 0)] * 3


def test_close_gives_back_with_the_history_of_release(db_url: str) -> None:
    # close() gives back in its own statements (driver-level SQL): the same rows as release().
    with WorkQueue(["a", "b", "c", "d"], shuffle=False, lease_ahead=3, auto_complete=False,
                   claim_ahead=False, name="q", url=db_url, worker="w") as wq:
        wq.release(wq.take())  # a, released by hand; b handed out and c claimed ahead: by close()
        assert wq.take() == "b"
    assert [(r.state, r.attempts) for r in audit(db_url, "q")] == [("pending", 0)] * 4
    rows = query(db_url, "SELECT e.seq, e.kind, w.name AS worker, e.token, e.detail, e.attempt, "
                         "e.claimed_at, e.at FROM wq_events e JOIN wq_workers w ON w.id = e.worker_id "
                         "ORDER BY e.seq")
    assert [tuple(r[:6]) for r in rows] == [(s, "release", "w", None, None, 0) for s in (0, 1, 2)]
    assert all(r.claimed_at is not None and r.at >= r.claimed_at for r in rows)
    assert query(db_url, "SELECT heartbeat_at FROM wq_workers WHERE name = 'w'")[0][0] is None


def test_leaving_with_block_on_exception_records_a_fail(db_url: str) -> None:
    with pytest.raises(RuntimeError):
        with WorkQueue(["a", "b", "c"], shuffle=False, lease_ahead=2, name="q", url=db_url,
                       worker="w") as wq:
            assert wq.take() == "a"
            raise RuntimeError("decoder crashed")
    rows = audit(db_url, "q")
    assert (rows[0].state, rows[0].attempts) == ("pending", 1)
    assert rows[0].last_error == "RuntimeError: decoder crashed"
    # b was only claimed ahead, never handed out: released, no attempt.
    assert (rows[1].state, rows[1].attempts, rows[1].last_error) == ("pending", 0, None)
    assert rows[2].state == "pending"
    kinds = {(r.seq, r.kind) for r in query(db_url, "SELECT seq, kind FROM wq_history")}
    assert (0, "fail") in kinds and (1, "release") in kinds


def test_keyboard_interrupt_releases_without_an_attempt(db_url: str) -> None:
    with pytest.raises(KeyboardInterrupt):
        with WorkQueue(["a"], name="q", url=db_url, worker="w") as wq:
            wq.take()
            raise KeyboardInterrupt
    row = audit(db_url, "q")[0]
    assert (row.state, row.attempts) == ("pending", 0)


def test_clean_with_exit_acks_the_handed_out_item(db_url: str) -> None:
    with WorkQueue(["a", "b"], shuffle=False, name="q", url=db_url, worker="w") as wq:
        wq.take()
    assert [r.state for r in audit(db_url, "q")] == ["done", "pending"]


# ---------------------------------------------------------------- progress and audit


def test_progress_counts(db_url: str) -> None:
    with WorkQueue(["a", "b", "c"], num_epochs=2, shuffle=False, max_attempts=1, name="q",
                   url=db_url, worker="w") as wq:
        p = wq.progress()
        assert isinstance(p, Progress)
        assert (p.total, p.done, p.failed, p.num_epochs, p.items_per_epoch) == (6, 0, 0, 2, 3)
        assert 1 <= p.epochs_created <= 2 and p.remaining == 6
        wq.take()
        wq.take()  # acks the first
        assert (wq.progress().done, wq.progress().remaining) == (1, 5)
        wq.fail(wq.take(), "x")  # the second is acked by this take; the third fails for good
        p = wq.progress()
        assert (p.done, p.failed, p.remaining) == (2, 1, 3)
        drain(wq)
        p = wq.progress()
        assert (p.done, p.failed, p.remaining, p.epochs_created) == (5, 1, 0, 2)
    # progress() and the audit view agree.
    counts = dict(query(db_url, "SELECT state, count(*) FROM wq_audit WHERE queue = 'q' GROUP BY state"))
    assert counts == {"done": 5, "failed": 1}
    # The documented per-worker query.
    per_worker = query(db_url, "SELECT worker, count(*) FROM wq_audit WHERE queue='q' AND state='done' "
                               "GROUP BY worker")
    assert [tuple(r) for r in per_worker] == [("w", 5)]


def test_audit_view_columns_and_work_without_prefix(db_url: str) -> None:
    with WorkQueue(["a.txt", "b.txt"], shuffle=False, prefix="/mnt/data/", name="q", url=db_url,
                   worker="w") as wq:
        item = wq.take()
        assert item == "/mnt/data/a.txt"
    engine = sa.create_engine(resolve_url(db_url), poolclass=NullPool)
    try:
        with engine.connect() as c:
            result = c.execute(sa.text("SELECT * FROM wq_audit ORDER BY epoch, seq"))
            assert list(result.keys()) == AUDIT_COLUMNS
            rows = result.all()
    finally:
        engine.dispose()
    assert [(r.queue, r.epoch, r.seq, r.work, r.worker, r.state, r.attempts) for r in rows] == [
        ("q", 0, 0, "a.txt", "w", "done", 0), ("q", 0, 1, "b.txt", None, "pending", 0)]
    assert rows[0].claimed_at is not None and rows[0].done_at is not None
    assert rows[1].claimed_at is None and rows[1].done_at is None
    assert rows[0].item_id == item.item_id
    # Each (epoch, seq) consumed once: the check the issue promises users can write.
    dup = query(db_url, "SELECT epoch, seq, count(*) FROM wq_history WHERE kind = 'done' "
                        "GROUP BY epoch, seq HAVING count(*) > 1")
    assert dup == []


def test_several_queues_side_by_side(db_url: str) -> None:
    train_works = [f"train-{i}" for i in range(8)]
    eval_works = ["eval-0", "eval-1"]
    with WorkQueue(train_works, num_epochs=2, shuffle=True, seed=1, name="train", url=db_url,
                   worker="w0") as train, \
         WorkQueue(eval_works, num_epochs=1, shuffle=False, name="eval", url=db_url,
                   worker="w0") as ev:
        got_train = [train.take() for _ in range(5)]
        got_eval = drain(ev)
        got_train += drain(train)
    assert got_eval == eval_works
    assert Counter(got_train) == Counter(train_works * 2)
    assert len(audit(db_url, "train")) == 16 and len(audit(db_url, "eval")) == 2
    names = [q["name"] for q in wq_sql.list_queues(db_url)]
    assert names == ["eval", "train"]
    # An eval queue can start a new round for each evaluation.
    wq_sql.reset_queue("eval", url=db_url)
    with WorkQueue(eval_works, num_epochs=1, shuffle=False, name="eval", url=db_url, worker="w0") as ev:
        assert drain(ev) == eval_works
    assert {r.state for r in audit(db_url, "train")} == {"done"}


def test_reset_queue_starts_over(db_url: str) -> None:
    with WorkQueue(WORKS, num_epochs=2, seed=5, name="q", url=db_url, worker="w") as wq:
        before = drain(wq)
    wq_sql.reset_queue("q", url=db_url)
    rows = audit(db_url, "q")
    assert [(r.epoch, r.state, r.attempts, r.worker) for r in rows] == [(0, "pending", 0, None)] * 6
    assert query(db_url, "SELECT count(*) FROM wq_history WHERE queue = 'q'")[0][0] == 0
    with WorkQueue(WORKS, num_epochs=2, seed=5, name="q", url=db_url, worker="w") as wq:
        assert wq.progress().done == 0
        assert drain(wq) == before  # same works, same seed: the same order again
    with pytest.raises(QueueNotFound):
        wq_sql.reset_queue("missing", url=db_url)


def test_drop_queue(db_url: str) -> None:
    with WorkQueue(WORKS, name="gone", url=db_url, worker="w") as wq:
        wq.take()
    with WorkQueue(["keep"], name="kept", url=db_url, worker="w"):
        pass
    assert wq_sql.drop_queue("gone", url=db_url) is True
    assert wq_sql.drop_queue("gone", url=db_url) is False
    with pytest.raises(QueueNotFound):
        WorkQueue.attach("gone", url=db_url, worker="w")
    for table in ("wq_items", "wq_works", "wq_workers", "wq_tallies", "wq_events"):
        n = query(db_url, f"SELECT count(*) FROM {table} t JOIN wq_queues q ON q.id = t.queue_id "
                          "WHERE q.name = 'kept'")[0][0]
        total = query(db_url, f"SELECT count(*) FROM {table}")[0][0]
        assert n == total, table  # nothing of "gone" is left behind
    assert [q["name"] for q in wq_sql.list_queues(db_url)] == ["kept"]
    # The name is free again, for another configuration.
    with WorkQueue(["new"], name="gone", url=db_url, worker="w") as wq:
        assert drain(wq) == ["new"]


SQLISH = [
    "'; DROP TABLE wq_items; --",
    "a' OR '1'='1",
    'x"; DELETE FROM wq_queues; --',
    "%s %(name)s :param ? $1",
    "\\'; SELECT pg_sleep(10); --",
    "Robert'); DROP TABLE students;--",
]


def test_quoted_names_and_sql_looking_works_are_data(db_url: str) -> None:
    name = "it's a \"queue\"; DROP TABLE wq_queues; --"
    with WorkQueue(SQLISH, shuffle=False, prefix="'%s", name=name, url=db_url,
                   worker="o'brien \"w\"") as wq:
        got = drain(wq)
    assert got == ["'%s" + w for w in SQLISH]
    rows = audit(db_url, name)
    assert [r.work for r in rows] == SQLISH
    assert {r.worker for r in rows} == {"o'brien \"w\""}
    with WorkQueue.attach(name, url=db_url, worker="x") as wq:
        assert wq.prefix == "'%s"
    assert [q["name"] for q in wq_sql.list_queues(db_url)] == [name]
    wq_sql.reset_queue(name, url=db_url)
    assert len(audit(db_url, name)) == len(SQLISH)
    assert wq_sql.drop_queue(name, url=db_url) is True
    # Every table is still there.
    for table in ("wq_items", "wq_queues", "wq_works", "wq_events"):
        assert query(db_url, f"SELECT count(*) FROM {table}")[0][0] == 0


@pytest.mark.parametrize("name", ["", "x" * 201, "a\x00b", None, 3])
def test_bad_queue_names(db_url: str, name: Any) -> None:
    with pytest.raises(InvalidInput, match="name"):
        WorkQueue(WORKS, name=name, url=db_url, worker="w")


# ---------------------------------------------------------------- documentation


def test_every_keyword_of_workqueue_is_documented_in_its_docstring() -> None:
    import inspect
    import re

    doc = WorkQueue.__doc__ or ""
    params = [p for p in inspect.signature(WorkQueue.__init__).parameters if p != "self"]
    assert [p for p in params if not re.search(rf"``{p}(=[^`]+)?``", doc)] == []  # ``x`` or ``x=1``


def test_the_readme_logging_recipe_shows_info_events(db_url: str) -> None:
    """The user guide's snippet, run as written, shows a lease expiry (INFO) from the ``wq_sql``
    logger."""
    import re

    from backends import ROOT, run_py

    readme = (ROOT / "docs" / "guide" / "work-queue.md").read_text(encoding="utf-8")
    recipe = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if 'getLogger("wq_sql")' in b)
    code = recipe + """
import sys
import time
import sqlalchemy as sa
from wq_sql import WorkQueue
from wq_sql.store.engine import resolve_url
url = sys.argv[1]
a = WorkQueue(["x"], name="q", url=url, worker="a", heartbeat_seconds=30)
a.take()
engine = sa.create_engine(resolve_url(url))
with engine.begin() as c:
    c.execute(sa.text("UPDATE wq_items SET lease_until = '2000-01-01 00:00:00.000000'"))
engine.dispose()
b = WorkQueue.attach("q", url=url, worker="b", heartbeat_seconds=0.2)
time.sleep(1.5)  # a few heartbeats of b: each returns expired leases to the queue
print("took", b.take(timeout=10))
"""
    p = run_py(code, db_url)
    assert "took x" in p.stdout
    assert re.search(r"wq_sql INFO created queue 'q'", p.stderr), p.stderr
    assert re.search(r"wq_sql INFO queue 'q': 1 item\(s\) whose lease expired went back", p.stderr), p.stderr
