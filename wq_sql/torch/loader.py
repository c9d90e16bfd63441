"""``DataLoader``: torch's, plus the trainer side of the hand-out/ack path (see ``handoff``)."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch.utils.data
from torch.utils.data import BatchSampler, default_collate, default_convert

from wq_sql.errors import InvalidInput
from wq_sql.torch.dataset import QueueDataset, QueuePasses
from wq_sql.torch.handoff import Acks, Handed, main_queue
from wq_sql.torch.sampler import QueueSampler


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` (same arguments) for a :class:`~wq_sql.torch.QueueDataset` or
    a map-style dataset with ``sampler=``:class:`~wq_sql.torch.QueueSampler`. It tells the queue
    what the training loop consumed: an item is done once the training step of the batch that
    holds its last record is over, which is when the loop asks for the next batch (sent in one
    transaction per 0.2 s of training, and at the end of each pass, so that when ``for batch in
    loader`` ends, its items are done). Prefetching and workers reading ahead never make an item
    done. Each ``iter(loader)`` is the pass of the next epoch (see ``QueueDataset``'s ``epochs``;
    ``set_epoch`` on the dataset or sampler overrides it).

    Breaking out of a pass leaves the items of the batches not yet trained claimed: the same
    DataLoader worker takes them back first in the next pass (an attempt counted), else they come
    back when their lease expires.
    """

    def __init__(self, dataset: Any, batch_size: Optional[int] = 1, shuffle: Optional[bool] = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Optional[Callable[[Any], Any]] = None, pin_memory: bool = False,
                 drop_last: bool = False, *args: Any, **kwargs: Any) -> None:
        tagged: Optional[_TaggedIndices] = None
        passes: QueuePasses
        if isinstance(dataset, QueueDataset):
            passes = dataset
            if collate_fn is None:
                collate_fn = default_collate if batch_size is not None else default_convert
            collate_fn = _Collate(collate_fn, dataset)
        elif isinstance(sampler, QueueSampler):
            passes = sampler
            if kwargs.get("in_order", True) is not True:
                raise InvalidInput("a QueueSampler needs in_order=True: batches are matched to the "
                                   "indices they were read for by their order")
            if batch_sampler is not None or shuffle:
                raise InvalidInput("sampler=QueueSampler(...) decides the order: pass no batch_sampler "
                                   "and no shuffle")
            if batch_size is not None:
                tagged = batch_sampler = _TaggedIndices(BatchSampler(sampler, batch_size, drop_last), sampler)
                sampler, batch_size, drop_last = None, 1, False
            else:
                tagged = sampler = _TaggedIndices(sampler, sampler)
        elif isinstance(batch_sampler, QueueSampler):
            raise InvalidInput("QueueSampler yields indices: pass it as sampler=, with batch_size=")
        else:
            raise InvalidInput("wq_sql.torch.DataLoader reads a QueueDataset, or a map-style dataset with "
                               "sampler=QueueSampler(...); for anything else use torch.utils.data.DataLoader")
        passes._trainer_acks = True
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
                         pin_memory, drop_last, *args, **kwargs)
        self._passes = passes
        self._tagged = tagged
        self._acks: Optional[Acks] = None
        self._acks_pid = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._passes.next_pass()
        if self._acks is None or self._acks_pid != os.getpid():
            self._acks = Acks(main_queue(self._passes.config, self._passes.worker))
            self._acks_pid = os.getpid()
        return self._pass(super().__iter__(), self._acks)

    def _pass(self, batches: Iterator[Any], acks: Acks) -> Iterator[Any]:
        """The hand-out/ack path's trainer side: asking for batch ``k + 1`` means the step of batch
        ``k`` is over, so its items are acknowledged (``Acks.trained``)."""
        last: list[Handed] = []
        tags: Optional[deque[list[Handed]]] = None
        try:
            for raw in batches:
                acks.trained(last)
                if isinstance(raw, _Batch):
                    data, last = raw.data, raw.handed
                else:
                    assert self._tagged is not None
                    if tags is None:
                        tags = self._tagged.tags
                    data, last = raw, tags.popleft()
                yield data
            acks.trained(last)
        finally:
            acks.flush()  # at the end of the pass, and after a break: what was trained is done


class _Batch:
    """A batch as it travels from a DataLoader worker to the main process: the collated data and
    the items whose last record it holds."""

    __slots__ = ("data", "handed")

    def __init__(self, data: Any, handed: list[Handed]) -> None:
        self.data, self.handed = data, handed

    def pin_memory(self, device: Any = None) -> _Batch:
        """``pin_memory=True``: torch's pin-memory thread calls this for objects it does not know."""
        from torch.utils.data._utils.pin_memory import pin_memory

        return _Batch(pin_memory(self.data, device), self.handed)


class _Collate:
    """Runs in the process that makes the batch: the user's collate function, then the items
    whose last record went into this batch (the loader side's ``Loader.drain``)."""

    def __init__(self, fn: Callable[[Any], Any], passes: QueuePasses) -> None:
        self.fn, self.passes = fn, passes

    def __call__(self, data: Any) -> _Batch:
        return _Batch(self.fn(data), self.passes.drain())


class _TaggedIndices:
    """Wraps the sampler (or batch sampler) of a :class:`QueueSampler`, in the main process: for
    each batch of indices it records the items whose last index the batch holds, in order, so that
    the data batch made from it (they come back in the same order) carries them."""

    def __init__(self, inner: Any, passes: QueuePasses) -> None:
        self.inner, self.passes = inner, passes
        self.tags: deque[list[Handed]] = deque()

    def __iter__(self) -> Iterator[Any]:
        tags = self.tags = deque()
        for element in self.inner:
            tags.append(self.passes.drain())
            yield element

    def __len__(self) -> int:
        raise TypeError("a QueueSampler has no len(): how many indices a rank gets is decided as it runs")
