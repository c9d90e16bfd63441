"""Creating a queue, or joining the one that exists: whichever worker comes first creates it
(one transaction: the queue, its works and epoch 0; the unique name makes concurrent creators
end with one queue), the others check that their configuration matches the stored one."""

from __future__ import annotations

import logging
from typing import Optional

from sqlalchemy import Connection

from wq_sql import ops
from wq_sql.db import Db
from wq_sql.engine import safe_url
from wq_sql.errors import QueueConfigMismatch, QueueNotFound
from wq_sql.mismatch import DEFAULT_MAX_ATTEMPTS, differences, extend_to
from wq_sql.plan import QueueSpec, new_seed
from wq_sql.sources import plan_items

log = logging.getLogger("wq_sql")


def open_queue(db: Db, name: str, spec: Optional[QueueSpec], max_attempts: Optional[int]) -> ops.QueueRow:
    """The queue row of ``name``, created from ``spec`` if there is none (``spec`` None: join
    only, :class:`QueueNotFound` if missing); :class:`QueueConfigMismatch` if the stored queue
    differs from ``spec``. Joining is one read transaction: the row, the check, the counters."""
    def look(c: Connection) -> tuple[Optional[ops.QueueRow], list[str], tuple[int, int]]:
        row = ops.queue_row(c, name)
        if row is None:
            return None, [], (0, 0)
        return row, differences(c, row, spec, max_attempts), ops.progress(c, row.id)

    row, diffs, (done, failed) = db.tx(look, read=True)
    if row is None and spec is None:
        raise QueueNotFound(f"no queue named {name!r} in {safe_url(db.url)}; create it "
                            "with WorkQueue(works, name=...) first")
    if row is None:
        assert spec is not None
        items = plan_items(spec.works, spec.num_slices, db.engine, spec.prefix)  # no transaction
        seed = spec.seed if spec.seed is not None else new_seed()

        def create(c: Connection) -> tuple[Optional[int], Optional[ops.QueueRow]]:
            qid = ops.create_queue(c, db.dialect, name, spec, items, seed,
                                   DEFAULT_MAX_ATTEMPTS if max_attempts is None else max_attempts)
            return qid, ops.queue_row(c, name)

        qid, created = db.tx(create)
        if created is None:
            raise QueueNotFound(f"queue {name!r} was dropped while this worker created it")
        row = created
        if qid is not None:
            log.info("created queue %r: %d items per epoch, %d epochs", name, row.n_works, row.num_epochs)
        else:  # another worker created it meanwhile: check against what it stored
            diffs, (done, failed) = db.tx(lambda c: (differences(c, created, spec, max_attempts),
                                                     ops.progress(c, created.id)), read=True)
    if diffs:
        raise QueueConfigMismatch(name, diffs, extend_to(row, spec))
    if done + failed >= row.n_works * row.num_epochs:
        log.warning("queue %r is already finished (%d done, %d failed): take() will raise "
                    "QueueExhausted. Use another name, or reset it to start over.", name, done, failed)
    return row
