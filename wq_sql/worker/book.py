"""The hand-out book of one queue object: which claimed items sit in its buffer, which were
handed out, which wait to be acknowledged. Pure bookkeeping, no I/O and no locking: the owner
(``WorkQueue``) holds its lock around every call."""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from typing import Any, Optional

from wq_sql.errors import InvalidInput
from wq_sql.store.statements import Claimed

log = logging.getLogger("wq_sql")
RECENT = 4096  # hand-outs that read() finds by their string alone


class WorkItem(str):
    """A work string as handed out (``prefix + work``), carrying which item it is, so that
    ``complete``/``release``/``fail`` act on exactly this hand-out even when works repeat."""

    __slots__ = ("work", "epoch", "seq", "item_id", "token", "attempts")
    work: str
    epoch: int
    seq: int
    item_id: int
    token: int
    attempts: int

    def __new__(cls, value: str, work: str, claimed: Claimed) -> WorkItem:
        self = super().__new__(cls, value)
        self.work, self.epoch, self.seq = work, claimed.epoch, claimed.seq
        self.item_id, self.token, self.attempts = claimed.id, claimed.token, claimed.attempts
        return self

    @classmethod
    def stored(cls, value: str, work: str, epoch: int, seq: int, item_id: int) -> WorkItem:
        """The item with id ``item_id`` as a reader sees it, outside any hand-out (token 0):
        what replay gives the run's reader."""
        return _work_item(value, work, epoch, seq, item_id, 0, 0)

    @property
    def key(self) -> tuple[int, int]:
        return (self.item_id, self.token)

    def __reduce__(self) -> Any:
        # Plain values: a Claimed (a dataclass) in the pickle makes it dearer to load (one more
        # object to rebuild per item), and wq_sql.torch pickles every item a DataLoader worker
        # hands to the trainer.
        return (_work_item, (str(self), self.work, self.epoch, self.seq, self.item_id, self.token,
                             self.attempts))


def _work_item(value: str, work: str, epoch: int, seq: int, item_id: int, token: int,
               attempts: int) -> WorkItem:
    """A :class:`WorkItem` from its pickled values."""
    item = str.__new__(WorkItem, value)
    item.work, item.epoch, item.seq = work, epoch, seq
    item.item_id, item.token, item.attempts = item_id, token, attempts
    return item


class Book:
    """``buffer``: claimed, not yet handed out (in hand-out order). ``out``: handed out, not yet
    acknowledged. ``acks``: to be marked done by the next transaction. The three pools never
    share an item."""

    def __init__(self, prefix: Optional[str]) -> None:
        self.prefix = prefix or ""
        self.buffer: deque[WorkItem] = deque()
        self.out: dict[int, WorkItem] = {}
        self.acks: dict[int, WorkItem] = {}
        self._recent: OrderedDict[str, WorkItem] = OrderedDict()

    def add(self, claimed: list[Claimed], works: Optional[dict[int, str]] = None) -> None:
        """Claimed items join the buffer, as items with their works: each row's own (a claim
        round's), else ``works`` by work index."""
        prefix, buffer = self.prefix, self.buffer
        for c in claimed:
            work = c.work if works is None else works[c.work_idx]
            assert work is not None, "a claimed row without its work, and no works given"
            buffer.append(WorkItem(prefix + work if prefix else work, work, c))

    def hand_one(self) -> WorkItem:
        """The first buffered item, now handed out (``take()``: the hot path, once per item)."""
        item = self.buffer.popleft()
        self.out[item.item_id] = item
        recent = self._recent
        recent[item] = item
        recent.move_to_end(item)
        if len(recent) > RECENT:
            recent.popitem(last=False)
        return item

    def hand_out(self, n: int) -> list[WorkItem]:
        """Up to ``n`` (at least 1) buffered items, now handed out."""
        if n <= 1:
            return [self.hand_one()]
        recent = self._recent
        got = [self.buffer.popleft() for _ in range(min(n, len(self.buffer)))]
        for item in got:
            self.out[item.item_id] = item
            recent[item] = item
            recent.move_to_end(item)
        while len(recent) > RECENT:
            recent.popitem(last=False)
        return got

    def ack_out(self) -> None:
        """Everything handed out is finished (``auto_complete``): acknowledge it next."""
        if self.out:
            self.acks.update(self.out)
            self.out.clear()

    def send_acks(self) -> list[WorkItem]:
        """The acknowledgements for the next transaction, taken off the book while in flight
        (``complete()``/``close()`` must not act on them a second time)."""
        sent = list(self.acks.values())
        self.acks.clear()
        return sent

    def unsend(self, sent: list[WorkItem]) -> None:
        """The transaction that carried ``sent`` failed: acknowledge them next time."""
        self.acks.update((a.item_id, a) for a in sent)

    def settle(self, sent: list[WorkItem], accepted: set[int], queue: str) -> list[WorkItem]:
        """After a transaction that acknowledged ``sent``: the ones the database refused (their
        lease was lost), logged at WARNING."""
        lost = []
        for item in sent:
            self.acks.pop(item.item_id, None)
            if item.item_id not in accepted:
                lost.append(item)
        if lost:
            log.warning("%d item(s) of queue %r were finished after their lease expired and were "
                        "handed to another worker meanwhile; their completion was rejected: %s",
                        len(lost), queue, ", ".join(f"(epoch {i.epoch}, seq {i.seq})" for i in lost))
        return lost

    def find(self, item: str) -> WorkItem:
        """The handed-out (or to-be-acknowledged) item ``item`` stands for."""
        if isinstance(item, WorkItem):
            found = self.out.get(item.item_id) or self.acks.get(item.item_id)
            if found is not None and found.token == item.token:
                return found
            raise InvalidInput(f"{item!r} (epoch {item.epoch}, seq {item.seq}) is not an item this "
                               "queue object holds: it was already completed, released or failed")
        for pool in (self.out, self.acks):
            for held in pool.values():
                if held == item:
                    return held
        raise InvalidInput(f"{item!r} is not an item this queue object holds; pass what take() returned")

    def recent(self, item: str) -> Optional[WorkItem]:
        """A recent hand-out, by itself or by its string (among the last ``RECENT``)."""
        return item if isinstance(item, WorkItem) else self._recent.get(item)

    def drop_buffered(self, keys: set[tuple[int, int]]) -> list[WorkItem]:
        """Take the buffered items of ``keys`` (``(id, token)``) off the buffer (taken back by
        the database); returns them."""
        if not keys:
            return []
        gone = [i for i in self.buffer if i.key in keys]
        if gone:
            self.buffer = deque(i for i in self.buffer if i.key not in keys)
        return gone

    def drop(self, item: WorkItem) -> None:
        self.out.pop(item.item_id, None)
        self.acks.pop(item.item_id, None)

    def tokens(self) -> set[int]:
        """The lease tokens of every item this object holds (for the heartbeat)."""
        return {i.token for pool in (self.buffer, self.out.values(), self.acks.values()) for i in pool}

    def known(self) -> set[int]:
        return {i.item_id for i in self.buffer} | self.out.keys() | self.acks.keys()

    def clear(self) -> None:
        self.buffer.clear()
        self.out.clear()
        self.acks.clear()
