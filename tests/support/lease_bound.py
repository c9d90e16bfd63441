"""Sampling the lease-ahead bound while a consumer reads: how many items this worker holds
claimed that its consumer has not reached yet (the buffer plus the hand-out in use).

A helper module for the bound tests of the core, the TensorFlow shim and the PyTorch shim."""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa


class Unreached:
    """After each record the consumer reads, :meth:`sample` counts the items the worker holds
    claimed whose work the consumer has not reached (no record of it read yet); :attr:`most`
    is the largest count seen."""

    def __init__(self, url: str, queue: str, worker: str) -> None:
        self.engine = sa.create_engine(url)
        self.queue, self.worker = queue, worker
        self.reached: set[str] = set()
        self.most = 0
        self.samples = 0

    def sample(self, reached: Iterable[str] = ()) -> int:
        self.reached.update(reached)
        with self.engine.connect() as c:
            claimed = c.execute(sa.text("SELECT work FROM wq_audit WHERE queue = :q AND worker = :w "
                                        "AND state = 'claimed'"),
                                {"q": self.queue, "w": self.worker}).scalars()
            n = sum(1 for work in claimed if work not in self.reached)
        self.most = max(self.most, n)
        self.samples += 1
        return n

    def close(self) -> None:
        self.engine.dispose()
