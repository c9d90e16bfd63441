"""Sliceable sources: works that wq_sql can count and cut into ranges, and read back range by range.

A work whose string starts with a registered scheme (``table:``, ``lines:``, or one of yours) is
counted once when the queue is created and cut into items ``<work>?start=<s>&end=<e>``
(DeepRec's format, appended even to a work that holds a ``?``); any other work is a plain
path, handed out whole as DeepRec does. Each item row keeps its bounds (JSON in
``wq_works.bounds``), so a reader reads exactly its records even if the data changed since.

A source is any object with these members (see :class:`Source`); register it with
:func:`register_source`::

    class Numbers:                       # works "range:<n>", records 0 .. n-1
        scheme = "range"
        def check(self, work): ...       # syntax only, no I/O; raise InvalidInput
        def size(self, work, engine): return int(work[6:])
        def slices(self, work, engine, k):
            return [Slice(s, e) for s, e in cut(self.size(work, engine), k)]
        def read(self, work, piece, engine, **options):
            return iter(range(piece.start, piece.end))
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from sqlalchemy import Engine

from wq_sql.errors import InvalidInput
from wq_sql.plan import PlannedItem, allocate, slice_name
from wq_sql.sources.base import Slice, Source
from wq_sql.sources.lines import LinesSource
from wq_sql.sources.range import RangeSource
from wq_sql.sources.table import TableSource, register_database
from wq_sql.store.redact import redact

log = logging.getLogger("wq_sql")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


_registry: dict[str, Source] = {}


def register_source(source: Source, *, replace: bool = False) -> None:
    """Make works ``<source.scheme>:...`` sliceable in this process (creators and readers both
    need it registered)."""
    scheme = getattr(source, "scheme", None)
    if not isinstance(scheme, str) or not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise InvalidInput("a source's scheme must be lower-case letters, digits, '+', '.' or '-', "
                           f"got {scheme!r}")
    for member in ("check", "size", "slices", "read"):
        if not callable(getattr(source, member, None)):
            raise InvalidInput(f"source {scheme!r} has no method {member}()")
    if scheme in _registry and not replace and _registry[scheme] is not source:
        raise InvalidInput(f"a source for {scheme!r}: works is already registered; pass replace=True")
    _registry[scheme] = source


def source_for(work: str) -> Optional[Source]:
    """The registered source of ``work``, or ``None`` for a plain path."""
    m = _SCHEME.match(work)
    return _registry.get(m.group(1).lower()) if m else None


def plan_items(works: Sequence[str], num_slices: Optional[int], engine: Engine,
               prefix: Optional[str] = None) -> list[PlannedItem]:
    """The items of one epoch: sliceable works counted and cut (``num_slices`` items in all,
    spread over the works by size, see :func:`wq_sql.plan.allocate`), plain works whole.

    Counting reads the sources (a file's size, ``count(*)`` of a table): call it outside any
    transaction of the queue's."""
    sources = [source_for(w) for w in works]
    for w, src in zip(works, sources):
        if src is not None:
            src.check(w)
    if all(src is None for src in sources):
        # DeepRec: num_slices does nothing for plain paths
        return [PlannedItem(w, of=i) for i, w in enumerate(works)]
    if prefix:
        raise InvalidInput("prefix= applies to plain paths; sliced works (table:, lines:, ...) must "
                           "name their data in full")
    sizes = [None if src is None else src.size(w, engine) for w, src in zip(works, sources)]
    counts = allocate(sizes, num_slices)
    if num_slices is not None and sum(counts) > num_slices:
        log.warning("num_slices=%d is less than the %d non-empty works: each work is one item",
                    num_slices, sum(counts))
    out: list[PlannedItem] = []
    for i, (w, src, size, k) in enumerate(zip(works, sources, sizes, counts)):
        if src is None:
            out.append(PlannedItem(w, of=i))
        elif size == 0 or k == 0:
            log.warning("work %r is empty: it yields no item", redact(w))
        else:
            pieces = src.slices(w, engine, k)
            if not pieces:
                log.warning("work %r became empty while it was sliced: it yields no item", redact(w))
            for p in pieces:
                bounds = {"work": w, "start": p.start, "end": p.end, "bounds": p.bounds}
                out.append(PlannedItem(slice_name(w, p.start, p.end), json.dumps(bounds, sort_keys=True),
                                       of=i))
    if not out:
        raise InvalidInput("every work is empty, so the queue would have no item; check the tables "
                           "or files named in works")
    return out


def read_slice(bounds: str, engine: Engine, **options: Any) -> Iterator[Any]:
    """The records of the item whose stored bounds are ``bounds`` (``wq_works.bounds``)."""
    b = json.loads(bounds)
    src = source_for(b["work"])
    if src is None:
        raise InvalidInput(f"no source is registered for {redact(b['work'])!r} in this process: call "
                           "wq_sql.register_source(...) as the queue's creator did")
    return src.read(b["work"], Slice(b["start"], b["end"], b["bounds"]), engine, **options)


register_source(TableSource())
register_source(LinesSource())
register_source(RangeSource())

__all__ = ["Slice", "Source", "PlannedItem", "register_source", "register_database", "source_for",
           "plan_items", "read_slice"]
