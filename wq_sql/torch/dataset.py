"""``QueueDataset``: an ``IterableDataset`` whose every DataLoader worker is a queue worker."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, Callable, Optional, Union

import torch
from sqlalchemy.engine import make_url
from torch.utils.data import IterableDataset, get_worker_info

from wq_sql.errors import InvalidInput
from wq_sql.plan import Work
from wq_sql.queue import WorkItem
from wq_sql.store.engine import resolve_url
from wq_sql.store.redact import safe_url
from wq_sql.torch.acks import close_main_queue, give_back_recovered, main_queue
from wq_sql.torch.claiming import (
    Lineage,
    Loader,
    Notes,
    QueueConfig,
    check_consumed,
    check_epochs,
    rank_name,
    torch_run,
)

log = logging.getLogger("wq_sql")

Reader = Callable[[WorkItem], Iterable[Any]]
_NOTHING = object()


class QueuePasses:
    """What :class:`QueueDataset` and :class:`~wq_sql.torch.QueueSampler` share: the queue's
    configuration, this rank's identity, the epoch of the next pass (shared with DataLoader
    worker processes through a shared-memory tensor, so ``set_epoch`` reaches persistent workers
    too) and, per process, the loader side of the hand-out/ack path (:class:`Loader`)."""

    def __init__(self, works: Optional[Sequence[Work]], num_epochs: int, shuffle: bool, seed: Optional[int],
                 prefix: Optional[str], num_slices: Optional[int], name: str, *, url: Any,
                 worker: Optional[str], epochs: str, consumed: str, lease_ahead: Optional[int],
                 schema: Optional[str], options: dict[str, Any]) -> None:
        if "engine" in options:
            raise InvalidInput("wq_sql.torch opens the queue in every DataLoader worker process, which "
                               "cannot share an engine: pass url= (and schema=)")
        if "auto_complete" in options:
            raise InvalidInput("wq_sql.torch decides when items are done: use consumed='trained', "
                               "'checkpoint' or 'taken'")
        self.epochs = check_epochs(epochs)
        self.consumed = check_consumed(consumed)
        self.worker = rank_name(worker)
        options = dict(options)
        if "run" not in options and torch_run() is not None:
            options["run"] = torch_run()
        self.config = QueueConfig(name, resolve_url(url).render_as_string(hide_password=False), schema,
                                  lease_ahead, options)
        create = None if works is None else dict(works=works, num_epochs=num_epochs, shuffle=shuffle,
                                                 seed=seed, prefix=prefix, num_slices=num_slices)
        # Created (or joined) here, in the main process, so that a configuration mismatch or an
        # unreachable database is raised where the dataset is made; the trainer side uses it.
        q = main_queue(self.config, self.worker, create)
        if self.consumed != "checkpoint":  # else the DataLoader's load_state_dict or first pass
            give_back_recovered(q)
        self.num_epochs = q.num_epochs
        self.items_per_epoch = q.items_per_epoch
        # [epoch of the next pass, whether set_epoch() said so], shared with DataLoader workers
        self._epoch = torch.zeros(2, dtype=torch.int64).share_memory_()
        self._epoch[0] = -1
        self._loader: Optional[Loader] = None  # this process's, made by its first pass
        self._loader_pid = 0
        self._trainer_acks = False  # a wq_sql.torch.DataLoader acknowledges for the trainer
        self.lineage = False  # QueueDataset(lineage=True): batches record their items' record ranges

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_loader"], state["_loader_pid"] = None, 0  # per process
        return state

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass the one of ``epoch`` (0-based), as ``DistributedSampler.set_epoch``:
        needed when a plain ``torch.utils.data.DataLoader`` runs the passes (a
        :class:`~wq_sql.torch.DataLoader` counts them itself) or to resume at a later epoch."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise InvalidInput(f"epoch must be an int >= 0, got {epoch!r}")
        self._epoch[0] = epoch
        self._epoch[1] = 1

    def next_pass(self) -> int:
        """Called by :class:`~wq_sql.torch.DataLoader` before each pass: the epoch it covers (the one
        after the previous pass, unless ``set_epoch`` said otherwise)."""
        if not int(self._epoch[1]):
            self._epoch[0] = int(self._epoch[0]) + 1
        self._epoch[1] = 0
        return int(self._epoch[0])

    @property
    def epoch(self) -> int:
        """The epoch of the pass running or last run (-1 before the first)."""
        return int(self._epoch[0])

    def state_dict(self) -> dict[str, Any]:
        """For torchdata's ``StatefulDataLoader``, which asks a dataset (or sampler) for its state
        instead of replaying its batches on resume (which would claim and drop items): the
        queue holds the state; the loader's own ``state_dict`` is the one to save."""
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """See :meth:`state_dict`: nothing to restore here (the loader's ``load_state_dict`` does)."""

    def _epoch_limit(self) -> Optional[int]:
        if self.epochs == "all":
            return None
        epoch = max(0, int(self._epoch[0]))
        return None if epoch >= self.num_epochs - 1 else epoch

    def start_pass(self, role: str) -> Loader:
        """Begin a pass in this process, whose loader is ``<rank>/<role>``."""
        if self.consumed != "taken" and not self._trainer_acks:
            raise InvalidInput(
                f"{type(self).__name__} with consumed={self.consumed!r} needs wq_sql.torch.DataLoader, "
                "which tells the queue what the training loop consumed; with another loader, pass "
                "consumed='taken' (DeepRec's rule: an item is done when the loader takes the next one, "
                "so a crash loses what the loader read ahead)")
        if self.lineage and not self._trainer_acks:
            raise InvalidInput("lineage=True needs wq_sql.torch.DataLoader, which numbers the training "
                               "steps and records each batch's items with its acknowledgements")
        if self._loader is None or self._loader_pid != os.getpid():
            taken = self.consumed == "taken"
            self._loader = Loader(self.config, f"{self.worker}/{role}", complete_read=taken,
                                  keys=self.consumed == "trained", lineage=self.lineage)
            self._loader_pid = os.getpid()
        self._loader.start(self._epoch_limit())
        return self._loader

    def close(self) -> None:
        """Leave the queue in this process: this process's loader gives back what it claimed but
        did not deliver, and the trainer side's queue object closes (it also happens at exit)."""
        if self._loader is not None and self._loader_pid == os.getpid():
            self._loader.close()
        self._loader, self._loader_pid = None, 0
        close_main_queue(self.config, self.worker)

    def drain(self) -> Notes:
        """For the batch being made in this process: the items whose last record it holds."""
        if self._loader is None or self._loader_pid != os.getpid():
            return ()
        return self._loader.drain()

    def take_lineage(self, n: int) -> Lineage:
        """For the batch being made in this process, of ``n`` records: which items and record
        ranges it holds (``Loader.take_lineage``)."""
        if self._loader is None or self._loader_pid != os.getpid():
            return ()
        return self._loader.take_lineage(n)

    def _warn_epoch(self, loader: Loader) -> None:
        if loader.delivered == 0 and loader.beyond is not None:
            log.warning("queue %r: the pass for epoch %s found only items of epoch %d; a plain DataLoader "
                        "needs set_epoch(epoch) before each pass (wq_sql.torch.DataLoader counts passes)",
                        self.config.name, loader.epoch_limit, loader.beyond)

    def _repr_args(self) -> str:
        url = safe_url(make_url(self.config.url))
        return (f"name={self.config.name!r}, url={url!r}, worker={self.worker!r}, epochs={self.epochs!r}, "
                f"consumed={self.consumed!r}")


_frozen: set[int] = set()


def _freeze_inherited_heap() -> None:
    """Once per DataLoader worker process: move the objects it has now (what it inherited from the
    main process, torch and all) to the garbage collector's permanent generation (``gc.freeze``),
    so that its full collections do not walk them. Opening a queue allocates enough long-lived
    objects to trigger one, and walking a forked heap touches (and copies) every page of it, in
    every worker, each pass."""
    if os.getpid() not in _frozen:
        _frozen.add(os.getpid())
        gc.freeze()


class QueueDataset(QueuePasses, IterableDataset):
    """An ``IterableDataset`` over a wq_sql queue: every DataLoader worker process claims items from
    the shared queue (dynamic sharding across ranks and workers), and yields each item, or its
    records::

        from wq_sql.torch import DataLoader, QueueDataset

        ds = QueueDataset(files, num_epochs=3, url="postgresql://...", read=read_lines)
        loader = DataLoader(ds, batch_size=64, num_workers=2)
        for epoch in range(3):
            for batch in loader:          # this epoch's records, every one exactly once
                train_step(batch)

    The arguments before ``*`` are :class:`wq_sql.WorkQueue`'s (DeepRec's): ``works`` (``None``:
    join an existing queue ``name``), ``num_epochs``, ``shuffle``, ``seed``, ``prefix``,
    ``num_slices``, ``name``. Keyword-only:

    - ``url``: the database (default ``$WQ_SQL_URL``); ``schema``, and the other keywords of
      ``WorkQueue`` but ``engine``, ``worker`` and ``auto_complete`` (``lease_seconds``,
      ``heartbeat_seconds``, ``max_attempts``, ``busy_timeout``, ...) pass through.
    - ``read``: what each item yields. ``None``: the item itself (a ``str``, the work with its
      prefix); a function ``read(item) -> iterable of records`` (module-level, so that ``spawn``
      workers can unpickle it); or ``"source"``: the queue's own readers, ``wq.read(item,
      **read_options)``, for sliced works (``table:``, ``lines:``, ``range:``).
    - ``epochs``: ``"each"`` (default): each pass of the DataLoader yields one epoch's items
      (pass ``k`` the items of epoch ``k`` and any of earlier epochs left over; the last pass
      whatever is left); ``"all"``: DeepRec's one pass over every epoch.
    - ``consumed``: ``"trained"`` (default): an item is done once the training step that used its
      last record is over, which :class:`~wq_sql.torch.DataLoader` reports from the main
      process; ``"checkpoint"``: once a checkpoint holding the DataLoader's ``state_dict()``
      covers it (see :meth:`wq_sql.torch.DataLoader.state_dict`); ``"taken"``: DeepRec's rule
      inside the loader (done when the loader takes the next item), for other loaders, at the
      price of losing what the loader read ahead in a crash.
    - ``worker``: this rank's identity; default from ``$WQ_SQL_WORKER``,
      ``$TORCHELASTIC_RUN_ID`` and ``$RANK`` (see :func:`wq_sql.torch.rank_name`). DataLoader
      worker ``k`` is ``<worker>/loader<k>``, so a restarted rank gets its items back first.
    - ``lineage``: record, for each training step of this rank, which items and record ranges
      its batch held (``wq_lineage``; ``wq-sql trace``; :class:`~wq_sql.torch.ReplayDataset`
      feeds a run's batches again), written with the acknowledgements. Needs
      :class:`~wq_sql.torch.DataLoader` and a reader that yields the same records for an item
      each time it reads it.
    - ``lease_ahead``: items a loader claims per round trip; by default (``None``) the core sizes
      it from the loader's own time per item, smaller near the end while other workers share
      the queue (:class:`wq_sql.worker.sizing.Sizer`, as for the TF shim); a number fixes it.

    A pass ends for a DataLoader worker as soon as nothing of it is claimable: it never waits for
    items other workers hold (they may be blocked in a collective that waits for this rank).
    Ranks then end a pass after different numbers of batches: under DDP iterate inside
    ``model.join()`` (see the module docstring).
    """

    def __init__(self, works: Optional[Sequence[Work]] = None, num_epochs: int = 1, shuffle: bool = True,
                 seed: Optional[int] = None, prefix: Optional[str] = None, num_slices: Optional[int] = None,
                 name: str = "work_queue", *, url: Any = None, read: Union[None, str, Reader] = None,
                 read_options: Optional[dict[str, Any]] = None, epochs: str = "each",
                 consumed: str = "trained", worker: Optional[str] = None, lease_ahead: Optional[int] = None,
                 schema: Optional[str] = None, lineage: bool = False, **options: Any) -> None:
        if read is not None and read != "source" and not callable(read):
            raise InvalidInput(f"read must be None, 'source' or a function item -> records, got {read!r}")
        if read_options and read != "source":
            raise InvalidInput("read_options= go to the queue's source readers: use it with read='source'")
        self.read = read
        self.read_options = dict(read_options or {})
        super().__init__(works, num_epochs, shuffle, seed, prefix, num_slices, name, url=url, worker=worker,
                         epochs=epochs, consumed=consumed, lease_ahead=lease_ahead, schema=schema,
                         options=options)
        if not isinstance(lineage, bool):
            raise InvalidInput(f"lineage must be True or False, got {lineage!r}")
        self.lineage = lineage
        # Each forked DataLoader worker opens the queue on an engine made here (no connection).
        self.config.prepare_children()

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is not None:
            _freeze_inherited_heap()
        loader = self.start_pass(f"loader{info.id if info is not None else 0}")
        lineage = self.lineage
        # Abandoned (break, a new iter(loader)): the loader keeps the item being read and the
        # records not yet in a batch for its next pass.
        while True:
            item = loader.next_item()
            if item is None:
                break
            last = _NOTHING
            count: Optional[int] = None
            try:
                records = self._records(loader, item)
                if isinstance(records, (list, tuple)):
                    # A sequence (what most readers return): its last record is known without
                    # looking ahead, so the others go out with no Python work per record.
                    if records:
                        if lineage:
                            loader.begin(item, len(records))
                        last = records[-1]
                        yield from islice(records, len(records) - 1)
                else:
                    if lineage:
                        loader.begin(item, None)
                    count = 0
                    for record in records:
                        if last is not _NOTHING:
                            yield last
                        last = record
                        count += 1
            except GeneratorExit:
                raise
            except BaseException as e:
                loader.failed(item, e)
                raise
            if last is _NOTHING:
                loader.empty(item)
                continue
            loader.read_out(item, count)  # before the yield: the batch that takes the last record carries it
            yield last
        self._warn_epoch(loader)

    def _records(self, loader: Loader, item: WorkItem) -> Iterable[Any]:
        if self.read is None:
            return (item,)
        if self.read == "source":
            return loader.queue.read(item, **self.read_options)
        assert callable(self.read)
        return self.read(item)

    def __repr__(self) -> str:
        return f"wq_sql.torch.QueueDataset({self._repr_args()})"
