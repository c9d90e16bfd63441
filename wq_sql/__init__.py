"""wq_sql: DeepRec's WorkQueue rebuilt as a transactional job table on SQLite and PostgreSQL.

``import wq_sql`` never imports TensorFlow; the TF shim is ``wq_sql.tf``.
"""

from wq_sql.admin import compact_queue, drop_queue, extend_queue, list_queues, reset_queue, upgrade
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
    "WqSqlError", "QueueExhausted", "QueueEmpty", "QueueConfigMismatch", "QueueNotFound",
    "DatabaseBusy", "DatabaseUnavailable", "SchemaOutdated", "WorkerConflict", "LeaseLost",
    "UnsafeDatabase", "InvalidInput",
]
__version__ = "0.1.0"
