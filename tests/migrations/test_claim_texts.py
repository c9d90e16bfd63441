"""The claim round's two texts (``wq_sql/claim.py``: one Postgres statement, SQLite's steps in
one ``BEGIN IMMEDIATE`` transaction) agree: the same rounds on a fresh queue of each backend
accept the same acks, claim the same items in the same order and leave the same rows behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import backends
import pytest
import sqlalchemy as sa
from backends import drop_pg_database, new_pg_database, table_rows

from wq_sql import WorkQueue
from wq_sql.store import statements
from wq_sql.store.dialects import Dialect
from wq_sql.store.driver import driver_statement, driver_transaction
from wq_sql.store.engine import make_engine, resolve_url
from wq_sql.store.hot.claim import ClaimRound, claim_round_text

WORKS = [f"w{i}" for i in range(7)]


@pytest.fixture
def pg_url(request: pytest.FixtureRequest) -> Iterator[str]:
    name = new_pg_database(request.getfixturevalue("pg_template"))
    try:
        yield backends.pg_url(name)
    finally:
        drop_pg_database(name)


def _rounds(url: str) -> dict[str, Any]:
    """Run a fixed script of claim rounds on a fresh queue at ``url``; return what each round said
    and the rows left behind, with ids and tokens replaced by (epoch, seq) and round numbers."""
    with WorkQueue(WORKS, num_epochs=1, shuffle=False, url=url, worker="w", name="q"):
        pass  # the queue, its first epoch and the worker's row
    engine = make_engine(resolve_url(url))
    try:
        with engine.connect() as c:
            qid = c.execute(sa.text("SELECT id FROM wq_queues WHERE name = 'q'")).scalar_one()
            wid = c.execute(sa.text("SELECT id FROM wq_workers WHERE queue_id = :q"), {"q": qid}).scalar_one()
        claim = ClaimRound(Dialect(engine.dialect.name), 3, lease_seconds=60)

        def run(acks: list[tuple[int, int]], limit: Any = None) -> tuple[set[int], list[Any]]:
            with driver_transaction(engine) as conn:
                return claim.run(conn, qid, wid, acks, limit)

        said: list[Any] = []
        pos: dict[int, tuple[int, int]] = {}

        def note(accepted: set[int], got: list[Any]) -> None:
            pos.update({c.id: (c.epoch, c.seq) for c in got})
            said.append((sorted(pos[i] for i in accepted),
                         [(c.epoch, c.seq, c.attempts, c.work) for c in got]))

        first = run([])
        note(*first)
        a, b, c = first[1]
        # Two good acks, one with a wrong token (fenced: not accepted), and three more claims.
        second = run([(a.id, a.token), (b.id, b.token), (c.id, c.token + 1)])
        note(*second)
        # Acks only (limit 0): the rest of what this worker holds, c's right token among them.
        note(*run([(x.id, x.token) for x in [c, *second[1]]], 0))
        note(*run([]))  # the last item

        with engine.connect() as conn:
            items = [tuple(r) for r in conn.execute(sa.text(
                "SELECT epoch, seq, state, attempts, worker_id IS NOT NULL, lease_until IS NOT NULL, "
                "claimed_at IS NOT NULL, done_at IS NOT NULL FROM wq_items WHERE queue_id = :q "
                "ORDER BY epoch, seq"), {"q": qid})]
            tallies = [tuple(r) for r in conn.execute(sa.text(
                "SELECT epoch, n_done, n_failed FROM wq_tallies WHERE queue_id = :q ORDER BY epoch"),
                {"q": qid})]
            history = sorted(tuple(r) for r in conn.execute(sa.text(
                "SELECT epoch, seq, kind FROM wq_history WHERE queue = 'q'")))
            clocks_agree = conn.execute(sa.text(
                "SELECT count(*) FROM wq_items WHERE queue_id = :q AND state = 'claimed' "
                "AND lease_until <= claimed_at"), {"q": qid}).scalar_one() == 0
        return {"said": said, "items": items, "tallies": tallies, "history": history,
                "clocks_agree": clocks_agree}
    finally:
        engine.dispose()


def test_sqlite_and_postgres_rounds_agree(tmp_path: Path, pg_url: str) -> None:
    lite = _rounds(f"sqlite:///{tmp_path / 'wq.db'}")
    pg = _rounds(pg_url)
    # What the script must give on any backend (so that two equally wrong texts cannot agree).
    assert lite["said"] == [
        ([], [(0, 0, 0, "w0"), (0, 1, 0, "w1"), (0, 2, 0, "w2")]),
        ([(0, 0), (0, 1)], [(0, 3, 0, "w3"), (0, 4, 0, "w4"), (0, 5, 0, "w5")]),
        ([(0, 2), (0, 3), (0, 4), (0, 5)], []),
        ([], [(0, 6, 0, "w6")]),
    ]
    assert lite["tallies"] == [(0, 6, 0)]
    assert [r[2] for r in lite["items"]] == ["done"] * 6 + ["claimed"]
    assert lite["clocks_agree"] and pg["clocks_agree"]
    assert pg == lite


def _gone_back_below(url: str) -> list[list[tuple[int, int]]]:
    """Two claimers take turns, the second gives an item back below where the first one's
    claims now start (Postgres' floor, see ``ClaimRound._floor``): the first one's later rounds,
    run as the hot path runs them (Postgres: one query in autocommit mode), must find it."""
    with WorkQueue([f"w{i}" for i in range(8)], num_epochs=1, shuffle=False, url=url, worker="w", name="q"):
        pass
    engine = make_engine(resolve_url(url))
    d = Dialect(engine.dialect.name)
    try:
        with engine.connect() as c:
            qid = c.execute(sa.text("SELECT id FROM wq_queues WHERE name = 'q'")).scalar_one()
            wid = c.execute(sa.text("SELECT id FROM wq_workers WHERE queue_id = :q"), {"q": qid}).scalar_one()
        first, second = ClaimRound(d, 2, lease_seconds=60), ClaimRound(d, 2, lease_seconds=60)

        def run(rnd: ClaimRound, acks: list[Any]) -> list[Any]:
            keys = [(a.id, a.token) for a in acks]
            if d.one_query_rounds:
                with driver_statement(engine) as (conn, prefix):
                    return rnd.run(conn, qid, wid, keys, None, prefix)[1]
            with driver_transaction(engine) as conn:
                return rnd.run(conn, qid, wid, keys)[1]

        a = run(first, [])
        b = run(second, [])
        c = run(first, a)
        e = run(first, c)
        with engine.begin() as conn:  # the second claimer gives its first item back
            assert statements.release(conn, d, qid, wid, [(b[0].id, b[0].token)]) == {b[0].id}
        f = run(first, e)  # nothing at or above where the first one's claims start: below
        g = run(first, f)
        return [[(x.epoch, x.seq) for x in got] for got in (a, b, c, e, f, g)]
    finally:
        engine.dispose()


def test_a_round_finds_an_item_gone_back_below_its_floor(tmp_path: Path, pg_url: str) -> None:
    want = [[(0, 0), (0, 1)], [(0, 2), (0, 3)], [(0, 4), (0, 5)], [(0, 6), (0, 7)], [(0, 2)], []]
    assert _gone_back_below(f"sqlite:///{tmp_path / 'wq.db'}") == want
    assert _gone_back_below(pg_url) == want


def test_warming_the_postgres_round_reads_and_writes_nothing(tmp_path: Path, pg_url: str) -> None:
    """``ClaimRound.warm`` runs every statement of ``wq_claim_round()`` once (acks, the claim
    from a floor and below it) for a queue that does not exist: every row stays as it was, on a
    queue with items pending, claimed and done."""
    with WorkQueue(WORKS, num_epochs=1, shuffle=False, url=pg_url, worker="w", name="q") as wq:
        wq.take()
        wq.take()  # the first one is done now, the second claimed
        engine = make_engine(resolve_url(pg_url))
        try:
            before = table_rows(engine)
            claim = ClaimRound(Dialect("postgresql"), 3, lease_seconds=60)
            with driver_statement(engine) as (conn, prefix):
                claim.warm(conn, prefix)
            assert table_rows(engine) == before
            with engine.connect() as c:
                states = set(c.execute(sa.text("SELECT state FROM wq_items")).scalars())
            assert states == {"done", "claimed", "pending"}
        finally:
            engine.dispose()
    ClaimRound(Dialect("sqlite"), 3, lease_seconds=60).warm(None, "")  # SQLite: nothing, no connection used


def test_the_migrated_claim_round_is_the_text_of_claim_round_sql(pg_url: str) -> None:
    """``store/hot/claim_round.sql`` is the function ``upgrade head`` leaves (migrations 0007 and
    0008 stay frozen): the same definition, compared as Postgres prints both
    (``pg_get_functiondef``), the file's text created in an empty database."""
    blank = new_pg_database(None)
    try:
        defs = []
        for url, create in ((pg_url, False), (backends.pg_url(blank), True)):
            engine = sa.create_engine(url)
            try:
                with engine.begin() as c:
                    if create:
                        c.exec_driver_sql(claim_round_text("").replace("%", "%%"))
                    defs.append(c.execute(sa.text(
                        "SELECT pg_get_functiondef('wq_claim_round'::regproc)")).scalar_one())
            finally:
                engine.dispose()
    finally:
        drop_pg_database(blank)
    assert defs[0] == defs[1]
    assert "v_now" in defs[0]  # 0008's change is in it
    assert "pg_advisory_xact_lock_shared" in defs[0]  # 0011's
