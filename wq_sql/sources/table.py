"""``table:``: a SQL table cut into key ranges.

Works::

    table:events                      the queue's own database (default schema)
    table:analytics.events            a schema-qualified table there
    table://warehouse/analytics.events  another database, named by an alias
    table:events?key=day,id           order by these columns instead of the primary key

An alias is configured outside the work string, so that works, audit rows, logs and summaries
never carry credentials: ``wq_sql.register_database("warehouse", url)`` in every process that
creates or reads the queue, or ``$WQ_SQL_DB_WAREHOUSE=postgresql://...``. A work with a user,
password or host in it is rejected.

At creation the table is counted and cut, in one read snapshot, at the keys of the records at
positions ``i * n // k`` in key order; item ``i`` reads the keys ``[key(start_i), key(start_i+1))``,
the last one up to the largest key counted, inclusive. The key ranges partition the table's key
space between its first and last key at creation, so every row there is read by exactly one
item, whatever is inserted or deleted meanwhile; rows inserted later beyond the last key are not
read. ``start``/``end`` in the item string are record positions as counted (DeepRec's format).
Reading pages through the range by key (``WHERE key > last ORDER BY key LIMIT n``), one short
transaction per page: no transaction stays open while records are used. NULL keys are refused.

Keyset paging and the cuts need a unique key: a key that is not known to be unique (it neither
contains the primary key nor the columns of a unique constraint or index) gets the primary key
appended as a tie-breaker (``?key=day`` orders by ``day, id``), and the bounds store the key
actually used. A table without a primary key must have a unique key: it is counted at creation
(``count(DISTINCT key)`` in the cut's snapshot) and refused if a value repeats.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import os
import re
import threading
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from sqlalchemy import (
    Column,
    Engine,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    UniqueConstraint,
    and_,
    case,
    desc,
    func,
    inspect,
    literal,
    or_,
    select,
    text,
    tuple_,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL
from sqlalchemy.sql.elements import ColumnElement, quoted_name

from wq_sql.errors import InvalidInput
from wq_sql.plan import cut
from wq_sql.sources.base import Slice
from wq_sql.store.dialects import dialect_of
from wq_sql.store.engine import make_engine, resolve_url
from wq_sql.store.redact import redact, safe_url

_IDENT = r"[A-Za-z_][A-Za-z0-9_]{0,62}"
_WORK = re.compile(r"^table:(?://(?P<alias>[^/?]*)/)?(?P<table>[^?]*)(?:\?(?P<query>.*))?$", re.S)
PAGE_ROWS = 1000


@dataclass(frozen=True)
class TableRef:
    alias: Optional[str]
    schema: Optional[str]
    name: str
    key: Optional[tuple[str, ...]]


def parse(work: str) -> TableRef:
    m = _WORK.match(work)
    shown = redact(work)
    if not m:
        raise InvalidInput(f"{shown!r} is not a table work: write table:<name>, table:<schema>.<name> "
                           "or table://<alias>/<name>, optionally ?key=<column>[,<column>]")
    alias, table, query = m.group("alias"), m.group("table"), m.group("query")
    if alias is not None and ("@" in alias or ":" in alias):
        raise InvalidInput(f"work {shown!r} carries connection details; name the database by an alias "
                           "(table://<alias>/<table>) and configure it with "
                           "wq_sql.register_database('<alias>', url) or $WQ_SQL_DB_<ALIAS>")
    if alias is not None and not re.fullmatch(_IDENT, alias):
        raise InvalidInput(f"database alias {alias!r} in {shown!r} must be a plain identifier "
                           "(letters, digits, _)")
    parts = table.split(".")
    if not 1 <= len(parts) <= 2 or not all(re.fullmatch(_IDENT, p) for p in parts):
        raise InvalidInput(f"table name {redact(table)!r} in {shown!r} must be <name> or <schema>.<name> "
                           "made of letters, digits and _ (other names cannot be sliced)")
    key = None
    if query is not None:
        params = dict(p.partition("=")[::2] for p in query.split("&"))
        unknown = sorted(redact(p) for p in set(params) - {"key"})
        if unknown:
            raise InvalidInput(f"unknown parameter(s) {unknown} in {shown!r}: only ?key=<column>[,<column>]")
        key = tuple(params["key"].split(","))
        if not all(re.fullmatch(_IDENT, k) for k in key):
            raise InvalidInput(f"key columns {redact(params['key'])!r} in {shown!r} must be plain "
                               "identifiers")
    return TableRef(alias, parts[0] if len(parts) == 2 else None, parts[-1], key)


# ---------------------------------------------------------------- databases by alias

_aliases: dict[str, Union[URL, Engine]] = {}
_engines: dict[Any, Engine] = {}
_lock = threading.Lock()


def register_database(alias: str, url: Union[str, URL, Engine]) -> None:
    """Name a database for ``table://<alias>/<table>`` works in this process (or set
    ``$WQ_SQL_DB_<ALIAS>``, upper case, to its URL)."""
    if not isinstance(alias, str) or not re.fullmatch(_IDENT, alias):
        raise InvalidInput(f"a database alias must be a plain identifier, got {redact(repr(alias))}")
    with _lock:
        _aliases[alias] = url if isinstance(url, Engine) else resolve_url(url)
        _engines.pop(alias, None)


def _reader_engine(alias: Optional[str], own: Engine) -> Engine:
    """An engine for reading sources: no statement timeout (counting a big table takes long),
    never the queue's schema translation, read-only transactions on SQLite."""
    key: Any = alias if alias is not None else ("own", own.url)
    with _lock:
        if key in _engines:
            return _engines[key]
        if alias is None:
            target: Union[URL, Engine] = own.url
        elif alias in _aliases:
            target = _aliases[alias]
        elif os.environ.get(f"WQ_SQL_DB_{alias.upper()}"):
            target = resolve_url(os.environ[f"WQ_SQL_DB_{alias.upper()}"])
        else:
            raise InvalidInput(f"no database is configured for alias {alias!r}: call "
                               f"wq_sql.register_database({alias!r}, url) or set $WQ_SQL_DB_{alias.upper()}")
        engine = target if isinstance(target, Engine) else make_engine(target, statement_timeout=None)
        engine = engine.execution_options(wq_read=True)
        _engines[key] = engine
        return engine


# ---------------------------------------------------------------- key values as JSON

def _encode(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dt.datetime):
        return {"datetime": v.isoformat()}
    if isinstance(v, dt.date):
        return {"date": v.isoformat()}
    if isinstance(v, decimal.Decimal):
        return {"decimal": str(v)}
    if isinstance(v, uuid.UUID):
        return {"uuid": str(v)}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"bytes": base64.b64encode(bytes(v)).decode()}
    raise InvalidInput(f"key values of type {type(v).__name__} cannot be stored as slice bounds; "
                       "choose a key of integers, strings, dates or decimals with ?key=<column>")


def _decode(v: Any) -> Any:
    if not isinstance(v, dict):
        return v
    (kind, s), = v.items()
    decoders: dict[str, Callable[[str], Any]] = {
        "datetime": dt.datetime.fromisoformat, "date": dt.date.fromisoformat,
        "decimal": decimal.Decimal, "uuid": uuid.UUID, "bytes": base64.b64decode}
    return decoders[kind](s)


# ---------------------------------------------------------------- the source

class TableSource:
    scheme = "table"

    def __init__(self) -> None:
        self._tables: dict[tuple[int, Optional[str], str], Table] = {}

    def check(self, work: str) -> None:
        parse(work)

    def _table(self, ref: TableRef, engine: Engine) -> tuple[Table, list[Column[Any]], bool]:
        """The table, the columns to order and cut it by (the key as given, with the primary key
        appended when the key is not known to be unique), and whether they are known to be unique
        (``False``: no primary key to break ties, so creation must count)."""
        cache = (id(engine), ref.schema, ref.name)
        table = self._tables.get(cache)
        if table is None:
            table = _reflect(ref, engine)
            self._tables[cache] = table
        if ref.key is None:
            keys = list(table.primary_key.columns)
            if not keys:
                raise InvalidInput(f"table {table.fullname!r} has no primary key: name a unique column to "
                                   f"order and cut it by, e.g. table:{table.fullname}?key=id")
            return table, keys, True
        missing = [k for k in ref.key if k not in table.c]
        if missing:
            raise InvalidInput(f"key column(s) {missing} are not in table {table.fullname!r}; "
                               f"it has {list(table.c.keys())}")
        keys, unique = _tie_broken(table, [table.c[k] for k in ref.key])
        return table, keys, unique

    def columns(self, work: str, engine: Engine, names: Optional[Sequence[str]] = None) -> list[Column[Any]]:
        """The table's columns called ``names`` (default: every column, in table order)."""
        ref = parse(work)
        table, _, _ = self._table(ref, _reader_engine(ref.alias, engine))
        if names is None:
            return list(table.c)
        missing = [redact(n) for n in names if n not in table.c]
        if missing:
            raise InvalidInput(f"column(s) {missing} are not in table {table.fullname!r}; "
                               f"it has {list(table.c.keys())}")
        return [table.c[n] for n in names]

    def size(self, work: str, engine: Engine) -> int:
        ref = parse(work)
        eng = _reader_engine(ref.alias, engine)
        table, keys, _ = self._table(ref, eng)
        with eng.connect() as c:  # one scan: the rows, and those with a NULL key
            n, nulls = c.execute(select(func.count(), func.coalesce(
                func.sum(case((_any_null(keys), 1), else_=0)), 0)).select_from(table)).one()
        if nulls:
            raise InvalidInput(f"{nulls} row(s) of {table.fullname!r} have a NULL key "
                               f"({', '.join(k.name for k in keys)}); they could never be read. "
                               "Choose another ?key=")
        return int(n)

    def slices(self, work: str, engine: Engine, k: int) -> list[Slice]:
        ref = parse(work)
        eng = _reader_engine(ref.alias, engine)
        table, keys, unique = self._table(ref, eng)
        with eng.connect() as c:
            c = c.execution_options(**dialect_of(eng).snapshot_options)  # count and cut in one snapshot
            with c.begin():
                n = int(c.execute(select(func.count()).select_from(table)).scalar_one())
                if n == 0:
                    return []
                if not unique:
                    distinct = select(func.count()).select_from(select(*keys).distinct().subquery())
                    repeated = n - int(c.execute(distinct).scalar_one())
                    if repeated:
                        raise InvalidInput(_not_unique(work, table, keys, repeated))
                k = min(k, n)
                pos = (func.row_number().over(order_by=keys) - 1).label("wq_pos")
                ranked = select(*keys, pos).subquery()
                # Exactly the positions i * n // k: for pos, i = ceil(pos * k / n) is the first
                # slice starting at or after pos, and pos is a start iff i * n // k == pos.
                is_start = text("((wq_pos * :k + :n - 1) / :n * :n) / :k = wq_pos").bindparams(k=k, n=n)
                rows = c.execute(select(ranked).where(is_start).order_by(ranked.c.wq_pos)).all()
                starts = {int(r[-1]): tuple(r[:-1]) for r in rows}
                last = tuple(c.execute(select(*keys).order_by(*[desc(x) for x in keys]).limit(1)).one())
        # The key is unique in this snapshot, so the cut keys differ and no range is empty.
        out: list[Slice] = []
        for s, e in cut(n, k):
            hi, incl = (last, True) if e == n else (starts[e], False)
            out.append(Slice(s, e, {"key": [x.name for x in keys], "lo": [_encode(v) for v in starts[s]],
                                    "hi": [_encode(v) for v in hi], "hi_inclusive": incl}))
        return out

    def read(self, work: str, piece: Slice, engine: Engine, **options: Any) -> Iterator[tuple[Any, ...]]:
        """Rows of the slice as tuples of ``columns=[...]`` (default: every column, in table
        order), fetched ``page_rows=`` at a time (default 1000)."""
        unknown = sorted(set(options) - {"columns", "page_rows"})
        if unknown:
            raise InvalidInput(f"table: works take the read options columns= and page_rows=, got {unknown}")
        columns: Optional[Sequence[str]] = options.get("columns")
        page_rows = options.get("page_rows", PAGE_ROWS)
        if isinstance(page_rows, bool) or not isinstance(page_rows, int) or page_rows < 1:
            raise InvalidInput(f"page_rows must be a positive int, got {redact(repr(page_rows))}")
        ref = parse(work)
        eng = _reader_engine(ref.alias, engine)
        table, _, _ = self._table(ref, eng)
        b = piece.bounds
        keys = [table.c[k] for k in b["key"]]
        # Bounds stored before the tie-breaker existed hold the key as given: the range stays a
        # range of that key, and the pages go by the key with the tie-breaker, so that a run of
        # equal keys longer than a page is read in full.
        pages, _ = _tie_broken(table, keys)
        selected = self.columns(work, engine, columns)
        lo = [_decode(v) for v in b["lo"]]
        hi = [_decode(v) for v in b["hi"]]
        within = and_(_compare(keys, lo, ">="), _compare(keys, hi, "<=" if b["hi_inclusive"] else "<"))
        after: Optional[list[Any]] = None
        nk = len(pages)
        while True:
            where = within if after is None else and_(within, _compare(pages, after, ">"))
            stmt = select(*pages, *selected).where(where).order_by(*pages).limit(page_rows)
            with eng.connect() as c, c.begin():
                rows = c.execute(stmt).all()
            for r in rows:
                yield tuple(r[nk:])
            if len(rows) < page_rows:
                return
            after = list(rows[-1][:nk])


def _reflect(ref: TableRef, engine: Engine) -> Table:
    """The table with every identifier quoted: reflected names are data, and a column or table
    named like a keyword of one dialect (``nothing``, ``order``) must still work."""
    insp = inspect(engine)
    if not insp.has_table(ref.name, schema=ref.schema):
        where = "the queue's database" if ref.alias is None else f"database {ref.alias!r}"
        name = f"{ref.schema}.{ref.name}" if ref.schema else ref.name
        raise InvalidInput(f"table {name!r} does not exist in {where} ({safe_url(engine.url)})")
    columns = [Column(quoted_name(c["name"], True), c["type"])
               for c in insp.get_columns(ref.name, schema=ref.schema)]
    pk = insp.get_pk_constraint(ref.name, schema=ref.schema).get("constrained_columns") or []
    extra: list[Any] = [PrimaryKeyConstraint(*[quoted_name(c, True) for c in pk])] if pk else []
    extra += [UniqueConstraint(*[quoted_name(c, True) for c in cols]) for cols in _unique_columns(ref, insp)]
    return Table(quoted_name(ref.name, True), MetaData(), *columns, *extra,
                 schema=quoted_name(ref.schema, True) if ref.schema else None)


def _unique_columns(ref: TableRef, insp: Any) -> list[list[str]]:
    """The column lists of the unique constraints and of the unique indexes over plain columns
    (a partial index, ``WHERE ...``, guarantees nothing for the rest of the table)."""
    out = [u["column_names"] for u in insp.get_unique_constraints(ref.name, schema=ref.schema)]
    with warnings.catch_warnings():  # an index on an expression is skipped, and that is fine here
        warnings.simplefilter("ignore", sa_exc.SAWarning)
        indexes = insp.get_indexes(ref.name, schema=ref.schema)
    for ix in indexes:
        options = ix.get("dialect_options", {})
        partial = any(k.endswith("_where") and v is not None for k, v in options.items())
        if ix.get("unique") and not partial and ix["column_names"] and None not in ix["column_names"]:
            out.append(ix["column_names"])
    return out


def _tie_broken(table: Table, keys: list[Column[Any]]) -> tuple[list[Column[Any]], bool]:
    """``keys`` if they are known to be unique (they contain the primary key or the columns of a
    unique constraint or index; NULL keys are refused, so SQL's NULLs in unique columns do not
    matter), else ``keys`` followed by the primary key's other columns. The flag says whether
    the result is known to be unique: ``False`` for a table without a primary key."""
    names = {k.name for k in keys}
    uniques = [c for c in table.constraints if isinstance(c, (PrimaryKeyConstraint, UniqueConstraint))]
    if any(len(c.columns) and {x.name for x in c.columns} <= names for c in uniques):
        return keys, True
    pk = list(table.primary_key.columns)
    return keys + [c for c in pk if c.name not in names], bool(pk)


def _not_unique(work: str, table: Table, keys: list[Column[Any]], repeated: int) -> str:
    given = ",".join(k.name for k in keys)
    return (f"key ({given}) of table {table.fullname!r} is not unique ({repeated} row(s) repeat a key "
            "value) and the table has no primary key to break ties, so rows could be read twice or never; "
            f"add a unique column as tie-breaker: {work.partition('?')[0]}?key={given},<unique column>")


def _compare(keys: list[Column[Any]], values: list[Any], op: str) -> ColumnElement[bool]:
    if len(keys) == 1:
        left: Any = keys[0]
        right: Any = values[0]
    else:
        left, right = tuple_(*keys), tuple_(*[literal(v, k.type) for k, v in zip(keys, values)])
    return {">=": left >= right, ">": left > right, "<=": left <= right, "<": left < right}[op]


def _any_null(keys: list[Column[Any]]) -> ColumnElement[bool]:
    return or_(*[k.is_(None) for k in keys])

