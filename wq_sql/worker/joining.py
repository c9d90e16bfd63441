"""Creating a queue, or joining the one that exists: whichever worker comes first creates it
(one transaction: the queue, its works and epoch 0; the unique name makes concurrent creators
end with one queue), the others check that their configuration matches the stored one.

What differs (:func:`differences`, also for ``wq-sql create``): joining compares the works by
their digest alone; only when the digests differ are the stored works read, in chunks and in
order, up to the first one that differs, so that the error can name it even for a queue of a
million works."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from sqlalchemy import Connection, select

from wq_sql.errors import QueueConfigMismatch, QueueNotFound
from wq_sql.mixing import Source
from wq_sql.plan import QueueSpec, new_seed, works_digest
from wq_sql.sources import plan_items
from wq_sql.store import mixing as mixing_store
from wq_sql.store import statements
from wq_sql.store.db import Db
from wq_sql.store.redact import safe_url

log = logging.getLogger("wq_sql")


def open_queue(db: Db, name: str, spec: Optional[QueueSpec],
               max_attempts: Optional[int], by: str = "") -> tuple[statements.QueueRow, bool]:
    """The queue row of ``name``, created from ``spec`` if there is none (``spec`` None: join
    only, :class:`QueueNotFound` if missing), and whether it has weighted sources;
    :class:`QueueConfigMismatch` if the stored queue differs from ``spec``. Joining is one read
    transaction: the row, the check, the counters, the sources. A creator ``by`` is recorded as
    the first mix of a weighted queue."""
    def look(c: Connection) -> tuple[Optional[statements.QueueRow], list[str], tuple[int, int, int],
                                     list[Source]]:
        row = statements.queue_row(c, name)
        if row is None:
            return None, [], (0, 0, 0), []
        return (row, differences(c, row, spec, max_attempts), statements.progress(c, row.id),
                mixing_store.load_sources(c, row.id))

    row, diffs, (done, failed, quarantined), sources = db.tx(look, read=True)
    if row is None and spec is None:
        raise QueueNotFound(f"no queue named {name!r} in {safe_url(db.url)}; create it "
                            "with WorkQueue(works, name=...) first")
    if row is None:
        assert spec is not None
        items = plan_items(spec.works, spec.num_slices, db.engine, spec.prefix)  # no transaction
        seed = spec.seed if spec.seed is not None else new_seed()

        def create(c: Connection) -> tuple[Optional[int], Optional[statements.QueueRow], list[Source]]:
            qid = statements.create_queue(c, db.dialect, name, spec, items, seed,
                                   DEFAULT_MAX_ATTEMPTS if max_attempts is None else max_attempts, by)
            row = statements.queue_row(c, name)
            return qid, row, [] if row is None else mixing_store.load_sources(c, row.id)

        qid, created, sources = db.tx(create)
        if created is None:
            raise QueueNotFound(f"queue {name!r} was dropped while this worker created it")
        row = created
        if qid is not None:
            log.info("created queue %r: %d items per epoch, %d epochs", name, row.n_works, row.num_epochs)
        else:  # another worker created it meanwhile: check against what it stored
            diffs, (done, failed, quarantined) = db.tx(lambda c: (differences(c, created, spec, max_attempts),
                                                     statements.progress(c, created.id)), read=True)
    if diffs:
        raise QueueConfigMismatch(name, diffs, extend_to(row, spec))
    if done + failed + quarantined >= row.n_works * row.num_epochs:
        log.warning("queue %r is already finished (%d done, %d failed, %d quarantined): take() will raise "
                    "QueueExhausted. Use another name, or reset it to start over.", name, done, failed,
                    quarantined)
    if sources and spec is not None and any(abs(s.weight - w) > 1e-9 for s, w in zip(sources, spec.weights)):
        log.info("queue %r: the weights in force (%s) stay; the weights given are not applied "
                 "(change them with wq-sql mix or wq_sql.set_mix)", name,
                 ", ".join(f"{s.name}={s.weight:.4g}" for s in sources))
    return row, bool(sources)


DEFAULT_MAX_ATTEMPTS = 3
# Stored works read per statement while looking for the first difference.
WORKS_CHUNK = 5_000
# A work longer than this is shown cut, in error messages.
SHOW_CHARS = 60


def differences(conn: Connection, row: Any, spec: Optional[QueueSpec],
                max_attempts: Optional[int]) -> list[str]:
    """Each setting of ``spec`` (``None``: attaching, no works given) and of an explicitly given
    ``max_attempts`` that the stored queue ``row`` contradicts, one phrase each. ``seed=None``
    joins any seed; ``prefix`` may change (data may move)."""
    diffs = []
    if spec is not None:
        if row.works_digest != spec.works_digest:
            diffs.append(sources_difference(conn, row, spec) or works_difference(conn, row, spec.works))
        if row.num_epochs != spec.num_epochs:
            diffs.append(f"num_epochs: stored {row.num_epochs}, given {spec.num_epochs}")
        if row.shuffle != spec.shuffle:
            diffs.append(f"shuffle: stored {row.shuffle}, given {spec.shuffle}")
        if row.num_slices != spec.num_slices:
            diffs.append(f"num_slices: stored {row.num_slices}, given {spec.num_slices}")
        if spec.seed is not None and row.seed != spec.seed:
            diffs.append(f"seed: stored {row.seed}, given {spec.seed}")
    if max_attempts is not None and row.max_attempts != max_attempts:
        diffs.append(f"max_attempts: stored {row.max_attempts}, given {max_attempts}")
    return diffs


def extend_to(row: Any, spec: Optional[QueueSpec]) -> Optional[int]:
    """The ``num_epochs`` given, if the stored queue could be extended to it."""
    return spec.num_epochs if spec is not None and spec.num_epochs > row.num_epochs else None


def sources_difference(conn: Connection, row: Any, spec: QueueSpec) -> Optional[str]:
    """How the stored sources and ``spec``'s differ, if their names or shape do (``None``: same
    names on both sides, or neither has sources: the works themselves differ)."""
    stored = mixing_store.load_sources(conn, row.id)
    if not stored and not spec.sources:
        return None
    if not stored:
        return ("the stored queue was created from a list of works, given named sources "
                f"({', '.join(n for n, _ in spec.sources)})")
    have = ", ".join(f"{s.name} ({s.n} items)" for s in stored)
    if not spec.sources:
        return f"the stored queue has named sources ({have}), given a list of works"
    if [s.name for s in stored] != [n for n, _ in spec.sources]:
        return (f"sources differ: stored {have}; given "
                f"{', '.join(f'{n} ({k} works)' for n, k in spec.sources)}")
    return None


def works_difference(conn: Connection, row: Any, given: Sequence[str]) -> str:
    """``works[i]`` where the stored works and ``given`` first differ, with both values and counts."""
    if row.num_slices is None:  # each work is one item (or none: a sliced work found empty)
        counts = f"{row.n_works} works stored, {len(given)} given"
    else:
        counts = f"{row.n_works} items stored (num_slices={row.num_slices}), {len(given)} works given"
    n = 0
    for i, stored in enumerate(stored_works(conn, row.id)):
        if i >= len(given):
            return f"works differ: works[{i}] is stored as {show(stored)}, not given ({counts})"
        if stored != given[i]:
            return f"works differ at works[{i}]: stored {show(stored)}, given {show(given[i])} ({counts})"
        n = i + 1
    if n < len(given):
        return f"works differ: works[{n}] is given as {show(given[n])}, not stored ({counts})"
    # Equal as far as the rows tell: a sliced work that was empty at creation has no row.
    return (f"works differ (stored digest {row.works_digest[:12]}..., given {works_digest(given)[:12]}... "
            f"for {len(given)} works; a work that was empty when the queue was created has no stored row)")


def stored_works(conn: Connection, qid: int) -> Iterator[str]:
    """The works as given at creation, in order, read ``WORKS_CHUNK`` rows at a time: a plain work
    is one row; the slices of a sliced work are consecutive rows whose bounds (JSON written by
    ``wq_sql.sources.plan_items``) name the work and continue each other's range."""
    w = statements.works_t
    after = -1
    last: Optional[tuple[str, Any]] = None  # the sliced work in progress and where its range ended
    while True:
        rows = conn.execute(select(w.c.idx, w.c.work, w.c.bounds)
                            .where(w.c.queue_id == qid, w.c.idx > after)
                            .order_by(w.c.idx).limit(WORKS_CHUNK)).all()
        for r in rows:
            if r.bounds is None:
                last = None
                yield r.work
                continue
            b = json.loads(r.bounds)
            continues = last is not None and last == (b["work"], b["start"])
            last = (b["work"], b["end"])
            if not continues:
                yield b["work"]
        if len(rows) < WORKS_CHUNK:
            return
        after = rows[-1].idx


def show(work: str) -> str:
    """A work as an error message shows it: quoted, cut to ``SHOW_CHARS`` characters."""
    if len(work) <= SHOW_CHARS:
        return repr(work)
    return f"{work[:SHOW_CHARS]!r}... ({len(work)} characters)"
