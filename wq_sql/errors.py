"""Exceptions raised by wq_sql. All derive from :class:`WqSqlError`."""

from __future__ import annotations

import shlex
from typing import Optional


class WqSqlError(Exception):
    """Base class of every wq_sql error."""


class QueueExhausted(WqSqlError):
    """Every item of every epoch is done, failed or quarantined; ``failed`` counts the failed
    ones, ``quarantined`` those whose work is in quarantine."""

    def __init__(self, queue: str, done: int, failed: int, quarantined: int = 0) -> None:
        self.queue, self.done, self.failed, self.quarantined = queue, done, failed, quarantined
        msg = f"queue {queue!r} is exhausted: {done} items done, {failed} failed"
        if quarantined:
            msg += f", {quarantined} quarantined"
        if failed:
            msg += " (see SELECT * FROM wq_audit WHERE state='failed')"
        super().__init__(msg)


class QueueEmpty(WqSqlError):
    """Nothing is claimable right now, but other workers still hold items (``take(timeout=...)``)."""


class QueueConfigMismatch(WqSqlError):
    """The stored queue was created with another configuration. ``extend_to``: the ``num_epochs``
    given, when it is more than the stored one (the queue can be extended to it)."""

    def __init__(self, queue: str, differences: list[str], extend_to: Optional[int] = None) -> None:
        self.queue, self.differences, self.extend_to = queue, differences, extend_to
        name = shlex.quote(queue)
        extend = (f" To add epochs to it: `python -m wq_sql extend {name} --epochs {extend_to}` "
                  f"(or wq.extend_epochs({extend_to})), then join again." if extend_to else "")
        super().__init__(
            f"queue {queue!r} exists with another configuration: {'; '.join(differences)}.{extend} "
            f"Use another name=, or start over with `python -m wq_sql reset {name}` "
            f"(or wq_sql.reset_queue(...))."
        )


class QueueNotFound(WqSqlError):
    """``WorkQueue.attach`` named a queue that does not exist."""


class DatabaseUnavailable(WqSqlError):
    """The database cannot be reached or opened: no server on that host and port, an unknown host,
    no such database or user, a wrong password, or a SQLite path that is a folder, not a SQLite
    file, read-only, or in a missing folder. Also raised when a database this queue object had
    reached stays unreachable past ``busy_timeout``. The message names the fix; the driver's
    error is its ``__cause__``."""


class DatabaseBusy(WqSqlError):
    """SQLite stayed locked by other writers for longer than ``busy_timeout``."""


class SchemaOutdated(WqSqlError):
    """The database schema is older (or newer) than this version of wq_sql expects."""


class WorkerConflict(WqSqlError):
    """Another live process already works under this worker identity."""


class LeaseLost(WqSqlError):
    """The item's lease expired and it was handed to someone else; this ack was rejected."""


class UnsafeDatabase(WqSqlError):
    """The database URL points at a place where wq_sql cannot guarantee safety."""


class InvalidInput(WqSqlError, ValueError):
    """Bad arguments; also a ``ValueError`` as in DeepRec."""
