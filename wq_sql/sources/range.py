"""``range:<n>``: the integers ``0 .. n-1``, cut into contiguous ranges.

The indices of a map-style dataset as a queue: ``WorkQueue(["range:10000"], num_slices=100)`` has
100 items of 100 indices each, and ``wq.read(item)`` yields an item's indices as ``int``. Nothing is
read from anywhere: the work names its size (``wq_sql.torch.QueueSampler`` is built on it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine

from wq_sql.errors import InvalidInput
from wq_sql.plan import cut
from wq_sql.sources.base import Slice

PREFIX = "range:"
_SIZE = re.compile(r"[0-9]{1,18}")


def _size(work: str) -> int:
    text = work[len(PREFIX):]
    if not _SIZE.fullmatch(text):
        raise InvalidInput(f"{work!r} is not range:<n> with n a non-negative integer (at most 18 digits)")
    return int(text)


class RangeSource:
    scheme = "range"

    def check(self, work: str) -> None:
        _size(work)

    def size(self, work: str, engine: Engine) -> int:
        return _size(work)

    def slices(self, work: str, engine: Engine, k: int) -> list[Slice]:
        n = _size(work)
        return [Slice(s, e) for s, e in cut(n, min(k, n))] if n else []

    def read(self, work: str, piece: Slice, engine: Engine, **options: Any) -> Iterator[int]:
        if options:
            raise InvalidInput(f"range: works take no read options, got {sorted(options)}")
        return iter(range(piece.start, piece.end))
