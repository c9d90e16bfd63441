"""``lines:<path>``: a text file cut into byte ranges, one record per line.

A range ``[start, end)`` owns the lines that *start* inside it: its reader skips the tail of a
line that began before ``start`` and finishes the line it is in at ``end``. So the ranges can be
cut anywhere, without reading the file at creation, and every line is read by exactly one item
(a range that falls inside one long line owns no line and yields nothing). Records are ``bytes``
without the line terminator (``\\n`` or ``\\r\\n``); ``tf.data.TextLineDataset`` also drops a ``\\r``
anywhere else in a line, these readers keep it.
The file must not change after the queue is created: a reader that finds another size refuses.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine

from wq_sql.errors import InvalidInput, WqSqlError
from wq_sql.plan import cut
from wq_sql.sources.base import Slice
from wq_sql.store.redact import redact

PREFIX = "lines:"


def _path(work: str) -> str:
    return work[len(PREFIX):]


class LinesSource:
    scheme = "lines"

    def check(self, work: str) -> None:
        if not _path(work):
            raise InvalidInput(f"{redact(work)!r} names no file: write lines:<path>")

    def size(self, work: str, engine: Engine) -> int:
        path = _path(work)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
        except OSError as e:
            raise InvalidInput(f"cannot read {redact(path)!r} of work {redact(work)!r}: "
                               f"{e.strerror}") from None
        if not os.path.isfile(path):
            raise InvalidInput(f"{redact(path)!r} of work {redact(work)!r} is not a regular file")
        return st.st_size

    def slices(self, work: str, engine: Engine, k: int) -> list[Slice]:
        n = self.size(work, engine)
        return [Slice(s, e, {"size": n}) for s, e in cut(n, min(k, n))] if n else []

    def read(self, work: str, piece: Slice, engine: Engine, **options: Any) -> Iterator[bytes]:
        if options:
            raise InvalidInput(f"lines: works take no read options, got {sorted(options)}")
        path = _path(work)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != piece.bounds.get("size", size):
                raise WqSqlError(f"{redact(path)!r} has {size} bytes, but {piece.bounds['size']} when the "
                                 "queue was created: its slices no longer match it. Recreate the queue.")
            start, end = piece.start, piece.end
            if start > 0:
                f.seek(start - 1)
                if f.read(1) != b"\n":
                    f.readline()  # the line in progress belongs to the previous range
            pos = f.tell()
            while pos < end:
                line = f.readline()
                if not line:
                    return
                pos += len(line)
                if line.endswith(b"\n"):
                    line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
                yield line
