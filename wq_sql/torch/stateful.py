"""``StatefulDataLoader``: torchdata's ``StatefulDataLoader`` with wq_sql's trainer side, for code
that expects that class (``pip install 'wq_sql[torch]'`` brings torchdata)."""

from __future__ import annotations

from torchdata.stateful_dataloader import StatefulDataLoader as _TorchdataLoader

from wq_sql.torch.loader import QueueLoading


class StatefulDataLoader(QueueLoading, _TorchdataLoader):
    """``torchdata.stateful_dataloader.StatefulDataLoader`` (same arguments) over a
    :class:`~wq_sql.torch.QueueDataset` or a map-style dataset with a
    :class:`~wq_sql.torch.QueueSampler`: :class:`~wq_sql.torch.DataLoader`'s behaviour, with its
    :meth:`state_dict` / :meth:`load_state_dict` (the queue holds where the data stands, so the
    state is small and resuming never replays batches)."""
