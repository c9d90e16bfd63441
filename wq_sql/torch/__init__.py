"""PyTorch on a wq_sql queue: dynamic sharding for ``DataLoader`` workers and ``torchrun`` ranks.

``pip install 'wq_sql[torch]'``; ``import wq_sql`` never imports torch, this package does::

    from wq_sql.torch import DataLoader, QueueDataset

    ds = QueueDataset(files, num_epochs=2, url="postgresql://user@db/jobs", read=read_records)
    loader = DataLoader(ds, batch_size=64, num_workers=2)        # torch's DataLoader, same arguments
    for epoch in range(2):
        for batch in loader:                                      # epoch's records, each exactly once
            train_step(batch)

- :class:`QueueDataset`: an ``IterableDataset``; every DataLoader worker process (or the main
  process with ``num_workers=0``) is a queue worker of its own, ``<rank>/loader<k>``, that opens
  its own connections (no connection made in the parent is used in a child: ``fork`` and
  ``spawn`` both work, and ``persistent_workers=True``; with ``fork`` the engine is made once,
  without a connection, in the parent). The rank's identity comes from
  ``$WQ_SQL_WORKER``, ``$TORCHELASTIC_RUN_ID`` and ``$RANK`` (:func:`rank_name`), so a restarted
  rank's workers get their items in flight back first.
- :class:`QueueSampler`: for a map-style dataset, ``sampler=QueueSampler(len(ds), ...)`` instead of
  ``DistributedSampler``: indices claimed range by range.
- :class:`DataLoader`: marks an item done once the training step of the batch holding its last
  record is over (the loop asked for the next batch), never because a worker read ahead.

**Passes and epochs.** Each pass (``iter(loader)``) is one epoch of the queue (``epochs="each"``):
pass ``k`` yields the items of epoch ``k`` (plus any left over from earlier epochs), the last
pass everything left; ``epochs="all"`` is DeepRec's single pass over every epoch. A DataLoader
worker's pass ends as soon as nothing of it is claimable: it never waits for items that other
workers hold (like the TF shim's ``synchronous=True``): a peer may be blocked in a collective
that waits for this rank, and a crashed process's items go to its restarted process first (or
to the next pass).

**DDP.** Ranks take different numbers of items, so their passes end after different numbers of
batches, and a rank that stops stepping would leave the others waiting in an all-reduce. Iterate
inside DDP's ``join()`` context, which shadows the collectives of ranks that ran out::

    model = torch.nn.parallel.DistributedDataParallel(net)
    for epoch in range(E):
        with model.join():
            for batch in loader:
                loss = model(batch).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()

(``tests/torch/test_torch_ranks.py`` runs it with two gloo ranks of different speeds.)

**Consumed.** With ``consumed="trained"`` (the default) a crash re-delivers the items whose
training step was not over (at least once; after the step, the acknowledgement may lag up to
0.2 s and its commit), to the restarted identity first. ``consumed="taken"`` is DeepRec's rule
inside the loader, for loaders other than :class:`DataLoader`; a crash then loses what the loader
had read ahead.

**Checkpoint-consistent resume.** With ``consumed="checkpoint"`` an item is done only once a
checkpoint holding the loader's ``state_dict()`` covers it (every batch yielded before the state
was taken); ``load_state_dict()`` resumes, and restoring an older checkpoint re-opens what it
does not cover::

    ds = QueueDataset(files, num_epochs=3, url=..., read=read_records, consumed="checkpoint")
    loader = DataLoader(ds, batch_size=64, num_workers=2)
    if os.path.exists(path):                                      # resume
        ckpt = torch.load(path)
        model.load_state_dict(ckpt["model"]); loader.load_state_dict(ckpt["loader"])
    ...
        torch.save({"model": model.state_dict(), "loader": loader.state_dict()}, path)

:class:`StatefulDataLoader` is the same over torchdata's ``StatefulDataLoader``. A restarted
torchrun job (same ``TORCHELASTIC_RUN_ID``, a higher ``TORCHELASTIC_RESTART_COUNT``, any number of
ranks) returns the previous incarnation's items to the queue as soon as its first process joins.
"""

from typing import Any

from wq_sql.torch.claiming import rank_name
from wq_sql.torch.dataset import QueueDataset
from wq_sql.torch.loader import DataLoader
from wq_sql.torch.replay import ReplayDataset
from wq_sql.torch.sampler import QueueSampler

__all__ = ["QueueDataset", "QueueSampler", "DataLoader", "ReplayDataset", "StatefulDataLoader", "rank_name"]


def __getattr__(name: str) -> Any:
    if name == "StatefulDataLoader":  # imports torchdata, only when asked for
        from wq_sql.torch.stateful import StatefulDataLoader

        return StatefulDataLoader
    raise AttributeError(f"module 'wq_sql.torch' has no attribute {name!r}")
