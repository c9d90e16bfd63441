"""What a sliceable source is: :class:`Slice` and the :class:`Source` protocol."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import Engine


@dataclass(frozen=True)
class Slice:
    """One item of a sliced work: records (or bytes) ``[start, end)`` as counted at creation, and
    whatever else the source needs to read exactly them later (JSON-able)."""

    start: int
    end: int
    bounds: dict[str, Any] = field(default_factory=dict)


class Source(Protocol):
    """What a sliceable source implements. ``engine`` is the queue's database, for sources that
    live there; sources must not keep a transaction open between calls."""

    scheme: str

    def check(self, work: str) -> None:
        """Reject a malformed work with :class:`InvalidInput` (no I/O)."""

    def size(self, work: str, engine: Engine) -> int:
        """How many records (or bytes) the work holds now; 0 = empty. The most items it can become."""

    def slices(self, work: str, engine: Engine, k: int) -> list[Slice]:
        """At most ``k`` non-empty slices covering the whole work, in order (the data may have
        changed since :meth:`size`: count again, in one snapshot)."""

    def read(self, work: str, piece: Slice, engine: Engine, **options: Any) -> Iterator[Any]:
        """The records of one slice, in order."""
