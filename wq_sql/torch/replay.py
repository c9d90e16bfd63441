"""``ReplayDataset``: the batches a rank trained on, fed again from the queue's lineage."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional, Union

from torch.utils.data import IterableDataset, default_collate, get_worker_info

from wq_sql.admin import replay_steps
from wq_sql.errors import InvalidInput
from wq_sql.queue import WorkItem
from wq_sql.sources import read_slice
from wq_sql.store.engine import make_engine, resolve_url
from wq_sql.store.lineage import Traced

Reader = Callable[[WorkItem], Iterable[Any]]


class ReplayDataset(IterableDataset):
    """The batches that rank ``worker`` trained on at ``steps`` (a ``range`` of its step
    numbers, as ``wq-sql trace`` prints them), in step order, record for record, read again
    from the queue's lineage (the run was trained with ``QueueDataset(..., lineage=True)``)::

        replay = ReplayDataset("train", url=url, worker="job-7/rank1", steps=range(41_220, 41_240),
                               read=read_lines)
        for batch in replay:             # the batches of steps 41,220 .. 41,239 of rank 1
            loss = model(batch)

    It claims nothing and writes nothing: the queue's state is untouched, so it may run beside
    the job. Each step is the rank's latest run that recorded it (``run``: that run; a restored
    checkpoint numbers its steps again, in a new run).

    - ``read``: the run's reader, as given to ``QueueDataset`` (``None``: the item itself;
      ``"source"``: the queue's own readers, with ``read_options``). It must yield the same
      records for an item as in the run.
    - ``collate_fn``: what makes a batch of a step's records (default ``default_collate``, the
      DataLoader's); a step's batch is exactly the records its lineage lists.
    - Through a ``torch.utils.data.DataLoader``: pass ``batch_size=None`` (each element is a
      batch already); with ``num_workers=k`` each worker reads every k-th step and the
      DataLoader's in-order round robin keeps the steps in order.

    A step of the range with no lineage (never reached, or trained but not acknowledged when
    the process was killed), an unknown worker or run, or a queue without lineage raises
    :class:`~wq_sql.InvalidInput` saying what was recorded."""

    def __init__(self, name: str, *, worker: str, steps: range, url: Any = None, run: Optional[int] = None,
                 read: Union[None, str, Reader] = None, read_options: Optional[dict[str, Any]] = None,
                 collate_fn: Optional[Callable[[list[Any]], Any]] = None,
                 schema: Optional[str] = None) -> None:
        if read is not None and read != "source" and not callable(read):
            raise InvalidInput(f"read must be None, 'source' or a function item -> records, got {read!r}")
        if read_options and read != "source":
            raise InvalidInput("read_options= go to the queue's source readers: use it with read='source'")
        self.url = resolve_url(url).render_as_string(hide_password=False)
        # per step, its batch's rows in order
        self.lineage = replay_steps(name, worker=worker, steps=steps, run=run, url=self.url, schema=schema)
        self.name, self.worker, self.steps = name, worker, steps
        self.read, self.read_options = read, dict(read_options or {})
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.schema = schema

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        n = len(self.lineage)
        mine = range(n) if info is None else range(info.id, n, info.num_workers)
        engine = None
        if self.read == "source":
            engine = make_engine(resolve_url(self.url), schema=self.schema, pool_size=1)
        cached: tuple[int, list[Any]] = (-1, [])
        try:
            for k in mine:
                batch: list[Any] = []
                for t in self.lineage[k]:
                    if cached[0] != t.item_id:
                        cached = (t.item_id, self._records(t, engine))
                    records = cached[1]
                    if t.last_record >= len(records):
                        raise InvalidInput(
                            f"the reader yields {len(records)} record(s) for {t.handed!r} (epoch {t.epoch}, "
                            f"seq {t.seq}), but step {t.step} trained its records "
                            f"{t.first_record}..{t.last_record}: replay needs the run's reader and "
                            "unchanged data")
                    batch.extend(records[t.first_record:t.last_record + 1])
                yield self.collate_fn(batch)
        finally:
            if engine is not None:
                engine.dispose()

    def _records(self, t: Traced, engine: Any) -> list[Any]:
        item = WorkItem.stored(t.handed, t.work, t.epoch, t.seq, t.item_id)
        if self.read is None:
            return [item]
        if self.read == "source":
            if t.bounds is None:
                raise InvalidInput(f"{t.work!r} is a plain work, read whole: replay it with the run's own "
                                   "reader (read=), not read='source'")
            return list(read_slice(t.bounds, engine, **self.read_options))
        assert callable(self.read)
        return list(self.read(item))

    def __repr__(self) -> str:
        return (f"wq_sql.torch.ReplayDataset({self.name!r}, worker={self.worker!r}, "
                f"steps=range({self.steps.start}, {self.steps.stop}))")
