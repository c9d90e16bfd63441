"""``QueueSampler``: the indices of a map-style dataset, claimed range by range from a queue."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, Optional

from torch.utils.data import Sampler

from wq_sql.errors import InvalidInput
from wq_sql.torch.dataset import QueuePasses

RANGE_SIZE = 256  # indices per item when num_slices is not given


class QueueSampler(QueuePasses, Sampler[int]):
    """A ``sampler`` for map-style datasets (``Dataset.__getitem__``) that shards dynamically: the
    indices ``0 .. num_samples-1`` are a queue of contiguous ranges (``range:<num_samples>`` cut
    into ``num_slices`` items, :mod:`wq_sql.sources.range`), and each rank's sampler claims the
    next range when it needs indices, so fast ranks take more of them than slow ones::

        from wq_sql.torch import DataLoader, QueueSampler

        sampler = QueueSampler(len(dataset), num_slices=100, num_epochs=3, url=...)
        loader = DataLoader(dataset, batch_size=64, sampler=sampler, num_workers=2)
        for epoch in range(3):
            for batch in loader:
                train_step(batch)

    It replaces ``DistributedSampler``: every rank passes the same arguments. The sampler runs in
    the main process (identity ``<worker>/sampler``); ``num_slices`` defaults to one item per
    ``RANGE_SIZE`` indices. With ``shuffle=True`` the items of each epoch come in a seeded random
    order and the indices within an item are shuffled too (seeded by the queue's seed, the epoch
    and the item). ``epochs``, ``consumed``, ``worker``, ``url`` and the queue's keywords as for
    :class:`~wq_sql.torch.QueueDataset`. With ``consumed='trained'`` (the default) it needs
    :class:`~wq_sql.torch.DataLoader` (with ``in_order=True``, the default), which marks a range
    done once the training step of the batch holding its last index is over. It has no
    ``len()``: how many indices a rank gets is decided as it runs.
    """

    def __init__(self, num_samples: Optional[int] = None, *, num_slices: Optional[int] = None,
                 num_epochs: int = 1, shuffle: bool = True, seed: Optional[int] = None,
                 name: str = "work_queue", url: Any = None, epochs: str = "each", consumed: str = "trained",
                 worker: Optional[str] = None, lease_ahead: Optional[int] = None,
                 schema: Optional[str] = None, **options: Any) -> None:
        if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)
                                        or num_samples < 1):
            raise InvalidInput(f"num_samples must be a positive int (len(dataset)), got {num_samples!r}")
        if num_samples is not None and num_slices is None:
            num_slices = -(-num_samples // RANGE_SIZE)
        works = None if num_samples is None else [f"range:{num_samples}"]
        super().__init__(works, num_epochs, shuffle, seed, None, num_slices, name, url=url, worker=worker,
                         epochs=epochs, consumed=consumed, lease_ahead=lease_ahead, schema=schema,
                         options=options)

    def __iter__(self) -> Iterator[int]:
        loader = self.start_pass("sampler")
        q = loader.queue
        while True:
            item = loader.next_item()
            if item is None:
                break
            indices = list(q.read(item))
            if q.shuffle:
                random.Random(f"{q.seed}/{item.epoch}/{item.seq}").shuffle(indices)
            yield from indices[:-1]
            loader.read_out(item)  # before the last index: the batch that takes it carries the item
            yield indices[-1]
        self._warn_epoch(loader)

    def __repr__(self) -> str:
        return f"wq_sql.torch.QueueSampler({self._repr_args()})"
