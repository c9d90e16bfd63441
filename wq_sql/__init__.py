"""wq_sql: DeepRec's WorkQueue rebuilt as a transactional job table on SQLite and PostgreSQL.

``import wq_sql`` never imports TensorFlow; the TF shim is ``wq_sql.tf``, the PyTorch one
``wq_sql.torch``. The library's parts: ``store/`` (every SQL text and connection), ``worker/``
(one queue object's runtime), ``monitor/`` (the read-only faces), ``sources/`` (sliced works);
``docs/design.md`` ("The map") draws them.
"""

from wq_sql import _moved
from wq_sql.admin import (
    compact_queue,
    drop_queue,
    extend_queue,
    list_queues,
    mix_report,
    quarantine,
    quarantined,
    reset_queue,
    set_mix,
    trace,
    unquarantine,
    upgrade,
)
from wq_sql.errors import (
    DatabaseBusy,
    DatabaseUnavailable,
    InvalidInput,
    LeaseLost,
    QueueConfigMismatch,
    QueueEmpty,
    QueueExhausted,
    QueueNotFound,
    SchemaOutdated,
    UnsafeDatabase,
    WorkerConflict,
    WqSqlError,
)
from wq_sql.queue import Progress, WorkItem, WorkQueue
from wq_sql.sources import register_database, register_source

__all__ = [
    "WorkQueue", "WorkItem", "Progress", "register_source", "register_database",
    "upgrade", "reset_queue", "drop_queue", "list_queues", "compact_queue", "extend_queue",
    "set_mix", "mix_report", "quarantine", "unquarantine", "quarantined", "trace",
    "WqSqlError", "QueueExhausted", "QueueEmpty", "QueueConfigMismatch", "QueueNotFound",
    "DatabaseBusy", "DatabaseUnavailable", "SchemaOutdated", "WorkerConflict", "LeaseLost",
    "UnsafeDatabase", "InvalidInput",
]
__version__ = "0.1.0"

_moved.install()  # the flat layout's import paths, deprecated


def __getattr__(name: str) -> object:
    """``wq_sql.engine`` and the other modules of the flat layout, as attributes (deprecated)."""
    if f"wq_sql.{name}" in _moved.MOVED:
        import importlib

        return importlib.import_module(f"wq_sql.{name}")
    raise AttributeError(f"module 'wq_sql' has no attribute {name!r}")
