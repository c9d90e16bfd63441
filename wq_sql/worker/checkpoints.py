"""Which handed-out items a model checkpoint covers: the book a framework shim keeps when items
become done only when a checkpoint that covers them is saved (``consumed="checkpoint"`` in
``wq_sql.tf`` and ``wq_sql.torch``). Framework-free; the shim brackets each save with
:meth:`Ledger.mark`, and :meth:`Ledger.cover` marks done in the queue what the save covers."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

from wq_sql.worker.book import WorkItem


class Covering(Protocol):
    """What :meth:`Ledger.cover` needs of the queue: ``WorkQueue.cover``."""

    def cover(self, items: Sequence[WorkItem], step: int, ambiguous: int = 0) -> list[WorkItem]: ...


@dataclass(frozen=True)
class Mark:
    """The hand-out counters at one instant: calls started, items handed out."""

    calls: int
    items: int


class Ledger:
    """The items this process handed out that no checkpoint covers yet, in hand-out order, with
    the hand-out call that produced them (``consumed='checkpoint'``). TensorFlow's threads hand
    out while the training thread saves: a save is bracketed by two :meth:`mark` calls, never
    by a lock (a hand-out waiting for a save that waits for it would deadlock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = 0
        self._items = 0
        self._held: list[tuple[int, int, WorkItem]] = []  # (call, index, item)
        # During CheckpointManager.save: marks taken right before and after each iterator's
        # serialization (see _bracket_iterators), else None.
        self.serialized: Optional[list[Mark]] = None
        self.ended = False  # the queue ran out for this worker

    def start(self) -> int:
        with self._lock:
            self._calls += 1
            return self._calls - 1

    def finish(self, call: int, items: list[WorkItem]) -> None:
        with self._lock:
            for item in items:
                self._held.append((call, self._items, item))
                self._items += 1

    def mark(self) -> Mark:
        with self._lock:
            return Mark(self._calls, self._items)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def covered(self, before: Mark, after: Mark, read_ahead: int) -> tuple[list[WorkItem], int]:
        """(items the save covers, hand-outs that overlapped it).

        ``read_ahead=0``, the iterator is in the checkpoint: saving an iterator waits for the
        ``GetNext`` calls in flight (prefetch, parallel map and interleave threads), so every
        call that started before the save began is in the saved state, once it finished. A
        call that started during the save may or may not be: it stays uncovered, so restoring
        this checkpoint delivers it again (at least once for those items). ``read_ahead=W``:
        an item counts once ``W`` more items were handed out before the save began."""
        with self._lock:
            if read_ahead == 0:
                covered = [i for c, _, i in self._held if c < before.calls]
                ambiguous = sum(1 for c, _, _ in self._held if before.calls <= c < after.calls)
                return covered, ambiguous
            return [i for _, n, i in self._held if n + read_ahead < before.items], 0

    def forget(self, items: list[WorkItem]) -> None:
        gone = {id(i) for i in items}
        with self._lock:
            self._held = [h for h in self._held if id(h[2]) not in gone]

    def cover(self, queue: Covering, step: int, before: Mark, after: Mark,
              read_ahead: int) -> tuple[int, int]:
        """The checkpoint at ``step`` was saved: mark done in ``queue`` what it covers
        (:meth:`covered`), stamped with ``step``, and forget it. Returns (items made done,
        ambiguous hand-outs)."""
        covered, ambiguous = self.covered(before, after, read_ahead)
        lost = queue.cover(covered, step, ambiguous)
        self.forget(covered)
        return len(covered) - len(lost), ambiguous
