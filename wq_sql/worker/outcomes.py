"""How this worker's deliveries end outside the claim round: one item completed, released or
failed; items a model checkpoint covers, or re-opened after a restore; items other workers
handed to this process, completed; and what is held when the worker leaves. Each is one
transaction fenced by ``(id, token)``, run under the hand-out loop's lock; the book of
hand-outs is settled after it. ``WorkQueue``'s verbs of the same names call these.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Callable, Optional, Union

from sqlalchemy import Connection

from wq_sql.errors import LeaseLost
from wq_sql.store import quarantine as quarantine_store
from wq_sql.store import statements
from wq_sql.store.db import Db
from wq_sql.store.hot import HotPath
from wq_sql.store.lineage import Steps
from wq_sql.worker.book import WorkItem
from wq_sql.worker.dispenser import Dispenser

log = logging.getLogger("wq_sql")
Handout = Union[WorkItem, tuple[int, int]]  # a hand-out, or its (id, token) key


def _key(item: Handout) -> tuple[int, int]:
    return item.key if isinstance(item, WorkItem) else item


class Outcomes:
    """The ending verbs of one queue object, over its database handle and its hand-out loop."""

    def __init__(self, db: Db, hot: HotPath, dispenser: Dispenser) -> None:
        self.db, self.hot, self.qid, self.d = db, hot, hot.qid, dispenser

    def complete(self, item: str) -> None:
        self._end(item, "complete", statements.complete)

    def release(self, item: str) -> None:
        self._end(item, "release", statements.release)

    def fail(self, item: str, error: str) -> None:
        limit = self.d.rules.max_attempts
        self._end(item, "fail", lambda c, dl, q, w, keys: statements.fail(c, dl, q, w, keys, error, limit))

    def _end(self, item: str, action: str, op: Callable[..., set[int]]) -> None:
        """End one handed-out item's delivery; :class:`LeaseLost` if its lease was lost meanwhile."""
        db, d = self.db, self.d
        with d.lock:
            d.check_usable()
            held = d.book.find(item)
            keys, wid = [held.key], d.member.worker_id
            accepted = db.tx(lambda c: op(c, db.dialect, self.qid, wid, keys))
            d.book.drop(held)
        if held.item_id not in accepted:
            raise LeaseLost(f"cannot {action} {held!r} (epoch {held.epoch}, seq {held.seq}): its lease "
                            "expired and another worker holds or finished it")
        if action == "complete":
            d.after_acks()
        else:
            d.made_claimable()  # back in the queue (a failure with attempts left too)

    def quarantine(self, item: str, reason: str, by: str) -> quarantine_store.QuarantineOutcome:
        """Put the work of the handed-out ``item`` in quarantine; the item leaves the book."""
        db, d = self.db, self.d
        with d.lock:
            d.check_usable()
            held = d.book.find(item)
            out = db.tx(lambda c: quarantine_store.quarantine_item(c, self.qid, held.item_id, reason, by))
            d.book.drop(held)
        d.after_acks(always=True)  # its items count as finished: the queue may have ended
        return out

    def cover(self, items: Sequence[WorkItem], step: int, ambiguous: int) -> list[WorkItem]:
        """Mark ``items`` done, stamped with the checkpoint ``step``; the items whose lease was lost."""
        db, d = self.db, self.d
        with d.lock:
            d.check_usable()
            held = [i for i in items if d.book.out.get(i.item_id) is i]
            keys, wid = [i.key for i in held], d.member.worker_id
            accepted = db.tx(lambda c: statements.cover(c, db.dialect, self.qid, wid, keys, step, ambiguous))
            for i in held:
                d.book.out.pop(i.item_id, None)
            lost = d.book.settle(held, accepted, d.rules.name)
        if accepted:
            d.after_acks()
        return lost

    def reopen_after(self, step: Optional[int], writer: Optional[str] = None,
                     departed: Sequence[tuple[str, Optional[int]]] = (), since: Optional[int] = None,
                     staying: Optional[Collection[str]] = None) -> int:
        """Put back what the restored model has not trained although checkpoints covered it (see
        ``WorkQueue.reopen_after``)."""
        db, d = self.db, self.d
        me = d.member.worker_id

        def restore(c: Connection) -> int:
            named = [n for n in [writer, *(name for name, _ in departed)] if n]
            ids = statements.worker_ids(c, self.qid, named)
            lineages: list[tuple[int, Optional[int]]] = [(me, step)]
            if writer and writer in ids and ids[writer] != me:
                lineages.append((ids[writer], step))
            lineages += [(ids[name], s) for name, s in departed if name in ids]
            gone = None
            if since is not None and staying is not None:
                known = {me, *(wid for wid, _ in lineages)}
                gone = ([wid for wid, name in statements.run_workers(c, self.qid, writer or d.rules.worker)
                         if wid not in known and name not in staying], since)
            return statements.reopen_after(c, db.dialect, self.qid, me, step, lineages, gone)

        with d.lock:
            d.check_usable()
            n: int = db.tx(restore)
        if n:
            d.made_claimable()
            log.warning("worker %r restored from checkpoint step %s: %d item(s) covered by later "
                        "checkpoints went back to queue %r", d.rules.worker, step, n, d.rules.name)
        return n

    def cover_listed(self, writer: str, ids: Sequence[int], step: int) -> int:
        """Mark done the items ``ids`` that a restored state of the identity ``writer`` lists as
        covered, if still claimed by it or back in the queue (``statements.cover_listed``)."""
        db, d = self.db, self.d
        me = d.member.worker_id

        def cover(c: Connection) -> int:
            wid = statements.worker_ids(c, self.qid, [writer]).get(writer)
            if wid is None or wid == me:
                return 0
            return statements.cover_listed(c, db.dialect, self.qid, me, wid, ids, step)

        with d.lock:
            d.check_usable()
            n: int = db.tx(cover)
        if n:
            d.after_acks()
        return n

    def event_mark(self) -> int:
        """The newest history row's id (``statements.event_mark``)."""
        return int(self.db.tx(statements.event_mark, read=True))

    def hand_off(self, items: Sequence[WorkItem]) -> None:
        """Stop tracking ``items``: another process acknowledges them."""
        d = self.d
        with d.lock:
            for item in items:
                if d.book.out.get(item.item_id) is item:
                    d.book.drop(item)

    def still_held(self, items: Sequence[WorkItem]) -> list[WorkItem]:
        wid = self.d.member.worker_id
        rows = self.db.tx(lambda c: statements.held_by(c, self.qid, wid), read=True)
        held = {(c.id, c.token) for c in rows}
        return [i for i in items if i.key in held]

    def complete_handed(self, handed: Mapping[int, Sequence[Handout]],
                        steps: Optional[Steps] = None) -> list[Handout]:
        """Mark done items other workers (``{holder worker id: items}``) handed to this process,
        each a ``WorkItem`` or its ``(id, token)`` key, and write ``steps`` (lineage rows) in the
        same transaction; returns those whose lease was lost."""
        d = self.d
        with d.lock:
            d.check_usable()
        work = [(holder, [_key(i) for i in items]) for holder, items in handed.items() if items]

        steps = steps if steps is not None and steps.rows else None
        accepted = self.hot.acknowledge(work, steps) if work or steps else set()
        missing = [k for _, keys in work for k in keys if k[0] not in accepted]
        if missing:  # rare: an outage may have lost a committed round's reply
            accepted |= self.db.tx(lambda c: statements.done_already(c, missing), read=True)
        lost = [i for items in handed.values() for i in items if _key(i)[0] not in accepted]
        if lost:  # the book of this object never held them: only the warning of Book.settle
            which = ", ".join(f"(epoch {i.epoch}, seq {i.seq})" if isinstance(i, WorkItem) else f"(id {i[0]})"
                              for i in lost)
            log.warning("%d item(s) of queue %r were finished after their lease expired and were handed "
                        "to another worker meanwhile; their completion was rejected: %s", len(lost),
                        d.rules.name, which)
        if accepted:
            d.after_acks()
        return lost

    def adopt_handed(self, handed: Mapping[int, Sequence[WorkItem]], lease_seconds: float,
                     steps: Optional[Steps] = None) -> list[WorkItem]:
        """Hold, under this worker, items other workers (``{holder worker id: items}``) handed to
        this process: they join this object's hand-outs (renewed by its heartbeat, covered by
        :meth:`cover`, given back by ``close()``), and write ``steps`` (lineage rows) in the same
        transaction. Returns the items whose lease was lost."""
        db, d, hot = self.db, self.d, self.hot
        with d.lock:
            d.check_usable()
            wid = d.member.worker_id

            def take(conn: Any) -> set[int]:
                accepted: set[int] = set()
                for holder, items in handed.items():
                    keys = [i.key for i in items]
                    accepted |= statements.adopt(conn, db.dialect, wid, holder, keys, lease_seconds)
                if steps is not None:
                    hot.write_steps(conn.connection, steps)
                return accepted

            steps = steps if steps is not None and steps.rows else None
            accepted = db.tx(take) if any(handed.values()) or steps else set()
            everything = [i for items in handed.values() for i in items]
            for i in everything:
                if i.item_id in accepted:
                    d.book.out[i.item_id] = i
            return d.book.settle(everything, accepted, d.rules.name)

    def leave(self, failed: Optional[BaseException]) -> None:
        """With the lock held, after ``Dispenser.close``: acknowledge what was handed out (given
        back instead when the consumer stopped early, failed when it raised ``failed``), give
        back what was claimed ahead, and leave the queue, in one transaction."""
        db, d, book = self.db, self.d, self.d.book
        done, give_back, failing = list(book.acks.values()), list(book.buffer), []
        if failed is not None and isinstance(failed, Exception):
            failing = list(book.out.values())
        elif d.rules.auto_complete and failed is None:
            done += list(book.out.values())
        else:
            give_back += list(book.out.values())
        error = f"{type(failed).__name__}: {failed}"[:10_000] if failing else ""
        wid, inc = d.member.worker_id, d.member.incarnation
        acks, back = [i.key for i in done], [i.key for i in give_back]

        try:
            if failing:  # the consumer raised (rare): statements.leave, SQLAlchemy's statements
                accepted = db.tx(lambda c: statements.leave(
                    c, db.dialect, self.qid, wid, inc, done=acks, give_back=back,
                    failing=[i.key for i in failing], error=error, max_attempts=d.rules.max_attempts))
            elif not acks:  # the usual close(): the last round acknowledged everything
                # Acknowledging nothing, the leave commits without waiting for the WAL flush
                # (Postgres; at the end of a drain every worker leaves at once, and each leave's
                # flush would wait on a disk busy with the others' writes). Losing it in a
                # server crash is harmless: the worker row keeps its last heartbeat and the
                # items given back stay claimed, the state of a worker SIGKILLed just before
                # close(), which its peers recover from once its heartbeat is stale (the chaos
                # suites); and no durable transaction can build on a lost leave, since any
                # later synchronous commit flushes the WAL up to and past it.
                self.hot.leave_lazily(wid, inc, back)
                accepted = set()
            else:
                # Driver-level SQL (HotPath.leave): on SQLite the machine's other writers wait
                # while this holds its turn, which SQLAlchemy's first compile of a statement
                # would lengthen.
                accepted = self.hot.leave(wid, inc, acks, back)
                missing = [k for k in acks if k[0] not in accepted]
                if missing:  # rare: an outage may have lost a committed attempt's reply
                    accepted |= db.tx(lambda c: statements.done_already(c, missing), read=True)
            book.settle(done, accepted, d.rules.name)
        finally:
            book.clear()
        if give_back or failing:
            d.ring()
        elif accepted:
            d.after_acks(always=True)  # once per worker: was its last acknowledgement the queue's?
