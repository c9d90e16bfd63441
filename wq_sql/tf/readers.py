"""TensorFlow readers for sliced works (``table:``, ``lines:``, registered sources): a
``tf.data.Dataset`` of the records of one item or of every item a queue hands out, and
``TableRecordReader``, the TF1 Reader of DeepRec's table example.

Records come from :meth:`wq_sql.WorkQueue.read` (Python), ``batch`` at a time through
``Dataset.from_generator`` and then one by one, so the per-record cost stays low. A line is a
scalar ``tf.string``; a table row is a tuple of scalars, one per column, typed from the
table's columns (integers ``int64``, floats and decimals ``float64``, booleans ``bool``,
everything else ``tf.string``, UTF-8). A NULL becomes 0, 0.0, False or an empty string.
"""

from __future__ import annotations

import datetime as dt
import decimal
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import numpy as np
import sqlalchemy as sa
import tensorflow as tf

from wq_sql.errors import InvalidInput
from wq_sql.plan import unslice
from wq_sql.queue import WorkItem, handed_out_by
from wq_sql.queue import WorkQueue as CoreQueue
from wq_sql.sources import source_for
from wq_sql.sources.table import TableSource

__all__ = ["item_dataset", "records_dataset", "TableRecordReader"]

BATCH = 1024
Kind = type  # int, float, bool or bytes: how one field is carried


def _core(wq: Any) -> CoreQueue:
    return wq if isinstance(wq, CoreQueue) else wq.queue


def _first_work(q: CoreQueue) -> str:
    return q.work_at(0)


def _kinds(q: CoreQueue, columns: Optional[Sequence[str]]) -> Union[Kind, tuple[Kind, ...]]:
    """How the records of ``q``'s works are carried: ``bytes`` for scalar records (lines), a
    tuple of kinds for table rows. Every work of the queue must give the same shape."""
    work = unslice(_first_work(q))
    src = source_for(work)
    if isinstance(src, TableSource):
        return tuple(_kind(c.type) for c in src.columns(work, q.engine, columns))
    if src is None:
        raise InvalidInput(f"queue {q.name!r} holds plain works ({work!r}): use input_dataset() with "
                           "your own reader, e.g. tf.data.TextLineDataset(wq.input_dataset())")
    if columns is not None:
        raise InvalidInput("columns= is for table: works")
    return bytes


def _kind(t: sa.types.TypeEngine[Any]) -> Kind:
    try:
        py = t.python_type
    except NotImplementedError:
        return bytes
    if issubclass(py, bool):
        return bool
    if issubclass(py, int):
        return int
    if issubclass(py, (float, decimal.Decimal)):
        return float
    return bytes


_DTYPES = {int: tf.int64, float: tf.float64, bool: tf.bool, bytes: tf.string}
_NP = {int: np.int64, float: np.float64, bool: np.bool_}


def _field(kind: Kind, values: list[Any]) -> np.ndarray:
    if kind is bytes:
        return np.array([_to_bytes(v) for v in values], dtype=object)
    zero = kind()
    return np.array([zero if v is None else v for v in values], dtype=_NP[kind])


def _to_bytes(v: Any) -> bytes:
    if v is None:
        return b""
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, (dt.date, dt.datetime, dt.time)):
        return v.isoformat().encode()
    return str(v).encode("utf-8")


def _batches(records: Iterator[Any], kinds: Union[Kind, tuple[Kind, ...]], batch: int) -> Iterator[Any]:
    chunk: list[Any] = []
    for r in records:
        chunk.append(r)
        if len(chunk) >= batch:
            yield _arrays(chunk, kinds)
            chunk = []
    if chunk:
        yield _arrays(chunk, kinds)


def _arrays(chunk: list[Any], kinds: Union[Kind, tuple[Kind, ...]]) -> Any:
    if not isinstance(kinds, tuple):
        return _field(kinds, chunk)
    return tuple(_field(k, [r[i] for r in chunk]) for i, k in enumerate(kinds))


def _signature(kinds: Union[Kind, tuple[Kind, ...]]) -> Any:
    if not isinstance(kinds, tuple):
        return tf.TensorSpec([None], _DTYPES[kinds])
    return tuple(tf.TensorSpec([None], _DTYPES[k]) for k in kinds)


def _find(item: Union[bytes, str]) -> tuple[CoreQueue, WorkItem]:
    """The core queue that handed ``item`` out, and the hand-out itself."""
    s = item.decode("utf-8") if isinstance(item, bytes) else item
    found = handed_out_by(s)
    if found is not None:
        return found
    raise InvalidInput(f"{s!r} was not handed out by a WorkQueue of this process")


def item_dataset(wq: Any, item: tf.Tensor, columns: Optional[Sequence[str]] = None,
                 batch: int = BATCH) -> tf.data.Dataset:
    """The records of one item (a scalar ``tf.string`` that ``wq`` handed out) as a dataset."""
    return _records_of(item, _kinds(_core(wq), columns), columns, batch)


def records_dataset(wq: Any, columns: Optional[Sequence[str]] = None, batch: int = BATCH) -> tf.data.Dataset:
    """Every record of every item ``wq`` hands out, item after item: ``wq.input_dataset()``
    flat-mapped through :func:`item_dataset`. An item is consumed when the next one is taken,
    which ``flat_map`` does only after the last record of the previous item was pulled."""
    kinds = _kinds(_core(wq), columns)  # now, with a clear error, rather than inside the pipeline
    return wq.input_dataset().flat_map(lambda item: _records_of(item, kinds, columns, batch))


def _records_of(item: tf.Tensor, kinds: Union[Kind, tuple[Kind, ...]], columns: Optional[Sequence[str]],
                batch: int) -> tf.data.Dataset:
    opts = {} if columns is None else {"columns": list(columns)}

    def gen(s: bytes) -> Iterator[Any]:
        owner, held = _find(s)
        yield from _batches(owner.read(held, **opts), kinds, batch)

    return tf.data.Dataset.from_generator(gen, args=(item,), output_signature=_signature(kinds)).unbatch()


class TableRecordReader:
    """DeepRec's ``tf.TableRecordReader`` for ``table:`` works, on a queue's ``input_producer()``::

        work_queue = WorkQueue(["table:events", "table:clicks"], num_slices=num_workers * 10)
        reader = TableRecordReader()
        keys, values = reader.read_up_to(work_queue.input_producer(), num_records=2)

    ``values`` are the selected columns of each row joined by ``csv_delimiter`` (DeepRec's
    format); ``keys`` are ``<item>:<position in the item>``. Each run returns up to
    ``num_records`` rows of the current item and dequeues the next item when it is used up;
    ``OutOfRangeError`` once the queue is closed and empty. Graph mode (``tf.compat.v1``)."""

    def __init__(self, csv_delimiter: str = ",", selected_cols: Optional[str] = None) -> None:
        self.csv_delimiter = csv_delimiter
        self.columns = None if not selected_cols else [c.strip() for c in selected_cols.split(",")]
        self._lock = threading.Lock()
        self._rows: Optional[Iterator[Any]] = None
        self._item = b""
        self._pos = 0

    def _needs_item(self) -> np.bool_:
        with self._lock:
            return np.bool_(self._rows is None)

    def _read(self, item: Any, n: np.int64) -> tuple[np.ndarray, np.ndarray]:
        item = item.item() if isinstance(item, np.ndarray) else item  # a 0-d array of bytes
        with self._lock:
            if self._rows is None:
                owner, held = _find(item)
                opts = {} if self.columns is None else {"columns": self.columns}
                self._rows, self._item, self._pos = owner.read(held, **opts), item, 0
            keys, values = [], []
            for row in self._rows:
                keys.append(b"%s:%d" % (self._item, self._pos))
                values.append(self.csv_delimiter.encode().join(_to_bytes(v) for v in row))
                self._pos += 1
                if len(keys) >= n:
                    break
            else:
                self._rows = None  # used up: the next run dequeues the next item
            return np.array(keys, dtype=object), np.array(values, dtype=object)

    def read_up_to(self, queue: Any, num_records: Union[int, tf.Tensor],
                   name: Optional[str] = None) -> tuple[tf.Tensor, tf.Tensor]:
        with tf.name_scope(name or "TableRecordReader"):
            need = tf.numpy_function(self._needs_item, [], tf.bool, stateful=True)
            item = tf.cond(need, lambda: queue.dequeue(), lambda: tf.constant(b""))
            keys, values = tf.numpy_function(self._read, [item, tf.cast(num_records, tf.int64)],
                                             [tf.string, tf.string], stateful=True)
        keys.set_shape([None])
        values.set_shape([None])
        return keys, values
