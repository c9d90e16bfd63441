"""What differs between a stored queue and the configuration a worker (or ``wq-sql create``) gives.

Joining compares the works by their digest alone; only when the digests differ are the stored
works read, in chunks and in order, up to the first one that differs, so that the error can name
it even for a queue of a million works.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from sqlalchemy import Connection, select

from wq_sql import ops
from wq_sql.plan import QueueSpec, works_digest

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
            diffs.append(works_difference(conn, row, spec.works))
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
    w = ops.works_t
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
