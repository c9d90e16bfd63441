"""``DataLoader``: torch's, plus the trainer side of the hand-out/ack path (``acks``; the loader
side is ``claiming``) and the loader state of checkpoint-consistent resume (``state_dict`` /
``load_state_dict``)."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

import torch.utils.data
from torch.utils.data import BatchSampler, default_collate, default_convert

from wq_sql.errors import InvalidInput
from wq_sql.torch.acks import Acks, Restored, give_back_recovered, main_queue
from wq_sql.torch.claiming import Lineage, Notes
from wq_sql.torch.dataset import QueueDataset, QueuePasses
from wq_sql.torch.sampler import QueueSampler
from wq_sql.torch.state import STATE_VERSION, LoaderState, parse, rank_of_job, staying_ranks


class QueueLoading:
    """What :class:`DataLoader` (and ``wq_sql.torch.StatefulDataLoader``) add to torch's loader
    class they are mixed with: the trainer side of the hand-out/ack path and the loader state."""

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
            collate_fn = _Collate(collate_fn, dataset, batched=batch_size is not None)
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
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers,  # type: ignore[call-arg]
                         collate_fn, pin_memory, drop_last, *args, **kwargs)
        self._passes = passes
        self._tagged = tagged
        self._acks: Optional[Acks] = None
        self._acks_pid = 0
        self._step = 0  # batches yielded, over every pass (restored by load_state_dict)
        self._looked = 0  # the pid that looked for its predecessor's departed loaders
        self._pass_ended = False

    def _trainer(self) -> Acks:
        if self._acks is None or self._acks_pid != os.getpid():
            self._acks = Acks(main_queue(self._passes.config, self._passes.worker),
                              checkpoint=self._passes.consumed == "checkpoint")
            self._acks_pid = os.getpid()
        return self._acks

    def __iter__(self) -> Iterator[Any]:
        acks = self._trainer()
        acks.saved()  # a state_dict() taken between passes went into a checkpoint meanwhile
        # What a crashed predecessor of this rank held and no load_state_dict() claimed: trained,
        # not covered by a checkpoint; back to the queue, for any loader to read again.
        give_back_recovered(acks.queue)
        if self._looked != os.getpid():
            # The previous process of this rank may have run more DataLoader workers than this
            # one: the identities beyond this one's never come back for their items (and no
            # pass waits for items others hold). Those of this one take theirs back themselves.
            self._looked = os.getpid()
            worker = self._passes.worker
            keep = ([f"{worker}/sampler"] if self._tagged is not None
                    else [f"{worker}/loader{k}" for k in range(max(1, getattr(self, "num_workers", 0)))])
            acks.queue.return_lost(lineage=worker, keep=keep)
        self._passes.next_pass()
        self._pass_ended = False
        return self._pass(super().__iter__(), acks)  # type: ignore[misc]

    def _pass(self, batches: Iterator[Any], acks: Acks) -> Iterator[Any]:
        """The hand-out/ack path's trainer side: asking for batch ``k + 1`` means the step of batch
        ``k`` is over, so its items are acknowledged (``Acks.trained``), and that a checkpoint
        holding a ``state_dict()`` taken after batch ``k`` was saved (``Acks.saved``)."""
        tags: Optional[deque[Notes]] = None
        # Waiting on data: from the training loop asking for a batch (resuming this generator)
        # to having it, summed in the rank's queue object, whose heartbeat sends it.
        add_wait = acks.queue.add_input_wait
        asked = time.perf_counter()
        try:
            for raw in batches:
                lineage = None
                if isinstance(raw, _Batch):
                    data, handed, lineage = raw.data, raw.handed, raw.lineage
                elif self._tagged is None:  # a batch that ends no item travels bare (_Collate)
                    data, handed = raw, ()
                else:
                    if tags is None:
                        tags = self._tagged.tags
                    data, handed = raw, tags.popleft()
                acks.yielded(handed, None if lineage is None else (self._step, lineage))
                self._step += 1
                add_wait(time.perf_counter() - asked)
                yield data
                asked = time.perf_counter()
                acks.saved()
            add_wait(time.perf_counter() - asked)  # the wait for the pass's end
            acks.yielded(())
            self._pass_ended = True
        finally:
            acks.flush()  # at the end of the pass, and after a break: what was trained is done

    def state_dict(self) -> dict[str, Any]:
        """The loader's state, for a checkpoint (``torch.save``, or torch.distributed.checkpoint as
        a ``Stateful``, as torchdata's ``StatefulDataLoader``): the batches yielded so far (the
        loader's step), the epoch, and whether its pass had ended. Every batch yielded so far
        counts as trained by the model saved with it.

        With ``consumed='checkpoint'`` the items of those batches become done, stamped with the
        step, once that checkpoint is saved: when the training loop asks for the next batch,
        begins the next pass, calls :meth:`checkpoint_saved`, or the process exits normally
        after the save; if the process was killed before that, when the state is restored (it
        lists the ids of the items it covers). Call it for the checkpoint you save (each rank
        its own)."""
        state: dict[str, Any] = {"version": STATE_VERSION, "queue": self._passes.config.name,
                                 "worker": self._passes.worker, "step": self._step,
                                 "epoch": self._passes.epoch, "pass_ended": self._pass_ended,
                                 "items": []}
        if self._passes.consumed == "checkpoint":
            state["items"], state["mark"] = self._trainer().save_point(self._step)
        return state

    def checkpoint_saved(self) -> int:
        """The checkpoint holding the last :meth:`state_dict` was saved (for a save that ends after
        the loop asks for the next batch, e.g. an asynchronous one): its items are done now.
        Returns how many."""
        return self._trainer().saved()

    def load_state_dict(self, state: dict[str, Any], departed: Sequence[dict[str, Any]] = ()) -> None:
        """Resume from a :meth:`state_dict` saved in a checkpoint, before iterating: the next pass
        is the epoch it was in (the one after, if its pass had ended) and the step goes on from
        its own. With ``consumed='checkpoint'`` the items this rank holds that no checkpoint
        covers go back to the queue, and so do those its later checkpoints had covered
        (``WorkQueue.reopen_after``): restoring an older checkpoint trains them again. The state
        may be another identity's (the job restarted under a new run id): its checkpoints count
        as this rank's.

        ``departed``: the states, from the same checkpoint, of ranks that did not come back (the
        job restarted with fewer ranks; pass them to one rank, rank 0): what their later
        checkpoints covered goes back too, compared with each one's own step. Without them,
        rank 0 of a ``torchrun`` job puts back what the departed ranks covered after its own
        state was taken (at least once: their share of this checkpoint may be trained again).

        A state that is not a loader state of this queue, of another format version, cut short,
        damaged, or whose later items were compacted away (``wq-sql compact``) raises
        :class:`~wq_sql.InvalidInput` and changes nothing."""
        name = self._passes.config.name
        mine = parse(state, name)
        others = [parse(d, name) for d in departed]
        if any(d.worker == mine.worker for d in others):
            raise InvalidInput(f"departed= holds a state of {mine.worker!r}, the rank restored: pass each "
                               "rank's state once, the ranks that did not come back in departed=")
        checkpointed = self._passes.consumed == "checkpoint"
        if checkpointed:
            self._check_not_compacted([mine, *others])
        self._step = mine.step
        if mine.next_epoch >= 0:
            self._passes.set_epoch(mine.next_epoch)
        if checkpointed:
            since, staying = None, None
            rank, world = rank_of_job()
            if rank == 0 and mine.mark is not None:
                staying = staying_ranks(mine.worker, world)
                since = mine.mark if staying is not None else None
            self._trainer().restore(mine.step, mine.items, writer=mine.worker,
                                    departed=[Restored(d.worker, d.step, d.items) for d in others],
                                    since=since, staying=staying)

    def _check_not_compacted(self, states: list[LoaderState]) -> None:
        """Restoring a state re-opens what later checkpoints covered, from the state's epoch on:
        those items must still be rows of the queue."""
        q = self._trainer().queue
        first = max(0, min(s.next_epoch for s in states))
        gone = [e for e in q.compacted_epochs() if e >= first]
        if gone:
            raise InvalidInput(
                f"this loader state is from epoch {first} of queue {q.name!r}, whose items of "
                f"epoch(s) {gone} were compacted away (wq-sql compact) since: restoring it could not "
                "re-open what later checkpoints covered, and the restored model would never see it. "
                "Resume from a checkpoint "
                f"saved after epoch {max(gone)}, or start the job afresh")


class DataLoader(QueueLoading, torch.utils.data.DataLoader):  # type: ignore[misc]
    """``torch.utils.data.DataLoader`` (same arguments) for a :class:`~wq_sql.torch.QueueDataset` or
    a map-style dataset with ``sampler=``:class:`~wq_sql.torch.QueueSampler`. It tells the queue
    what the training loop consumed: an item is done once the training step of the batch that
    holds its last record is over, which is when the loop asks for the next batch (sent in one
    transaction per 0.2 s of training, from a background thread, and at the end of each pass,
    which waits for them, so that when ``for batch in loader`` ends, its items are done).
    Prefetching and workers reading ahead never make an item done. Each ``iter(loader)`` is the
    pass of the next epoch (see ``QueueDataset``'s ``epochs``; ``set_epoch`` on the dataset or
    sampler overrides it).

    With ``consumed='checkpoint'`` on the dataset (or sampler), an item is done only once a
    checkpoint holding :meth:`state_dict` covers it; :meth:`load_state_dict` resumes::

        ds = QueueDataset(files, num_epochs=3, url=..., read=read_lines, consumed="checkpoint")
        loader = DataLoader(ds, batch_size=64, num_workers=2)
        if os.path.exists(path):
            ckpt = torch.load(path)
            model.load_state_dict(ckpt["model"]); loader.load_state_dict(ckpt["loader"])
        ...
            torch.save({"model": model.state_dict(), "loader": loader.state_dict()}, path)

    Breaking out of a pass leaves the items of the batches not yet trained claimed: the same
    DataLoader worker takes them back first in the next pass (an attempt counted), else they come
    back when their lease expires.
    """


class _Batch:
    """A batch as it travels from a DataLoader worker to the main process: the collated data,
    the items whose last record it holds and, with lineage, the items and record ranges it
    holds."""

    __slots__ = ("data", "handed", "lineage")

    def __init__(self, data: Any, handed: Notes, lineage: Optional[Lineage] = None) -> None:
        self.data, self.handed, self.lineage = data, handed, lineage

    def __reduce__(self) -> Any:
        # Positional: the default state of a __slots__ class pickles as a dict of slot names,
        # dearer each way, every batch.
        return (_Batch, (self.data, self.handed, self.lineage))

    def pin_memory(self, device: Any = None) -> _Batch:
        """``pin_memory=True``: torch's pin-memory thread calls this for objects it does not know."""
        from torch.utils.data._utils.pin_memory import pin_memory

        return _Batch(pin_memory(self.data, device), self.handed, self.lineage)


class _Collate:
    """Runs in the process that makes the batch: the user's collate function, then the items
    whose last record went into this batch (the loader side's ``Loader.drain``), wrapped with it in
    a :class:`_Batch`; a batch that ends no item goes as the collated data alone (with 1,000-record
    files and batches of 256, three batches in four: less to pickle and load per batch), unless
    lineage is on: every batch then carries its items' record ranges (``Loader.take_lineage``:
    the batch's samples are the next ones this process's dataset iterator yielded)."""

    def __init__(self, fn: Callable[[Any], Any], passes: QueuePasses, batched: bool = True) -> None:
        self.fn, self.passes, self.batched = fn, passes, batched

    def __call__(self, data: Any) -> Any:
        batch = self.fn(data)
        handed = self.passes.drain()
        if self.passes.lineage:
            return _Batch(batch, handed, self.passes.take_lineage(len(data) if self.batched else 1))
        return _Batch(batch, handed) if handed else batch


class _TaggedIndices:
    """Wraps the sampler (or batch sampler) of a :class:`QueueSampler`, in the main process: for
    each batch of indices it records the items whose last index the batch holds, in order, so that
    the data batch made from it (they come back in the same order) carries them."""

    def __init__(self, inner: Any, passes: QueuePasses) -> None:
        self.inner, self.passes = inner, passes
        self.tags: deque[Notes] = deque()

    def __iter__(self) -> Iterator[Any]:
        tags = self.tags = deque()
        for element in self.inner:
            tags.append(self.passes.drain())
            yield element

    def state_dict(self) -> dict[str, Any]:
        return {}  # see QueuePasses.state_dict

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __len__(self) -> int:
        raise TypeError("a QueueSampler has no len(): how many indices a rank gets is decided as it runs")
