"""Pure functions that decide what the rows of a queue are: validation, the config digest,
the per-epoch shuffle, and slicing. No database access here.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, TypeVar, Union

from wq_sql.errors import InvalidInput

Work = Union[str, bytes]
# epoch_order(breathe=): swaps, and indexes of the initial array, between two calls (each run
# between two calls a short hold of the GIL, well under Python's switch interval).
SHUFFLE_SLICE, FILL_SLICE = 1024, 16384


@dataclass(frozen=True)
class QueueSpec:
    """The configuration every worker must agree on (``prefix`` excepted: data may move)."""

    works: tuple[str, ...]
    num_epochs: int
    shuffle: bool
    seed: Optional[int]
    num_slices: Optional[int]
    prefix: Optional[str]
    # A weighted queue: its sources' names and how many of ``works`` each holds, in order, and
    # the weights given at creation (normalised to sum to 1). Empty: a plain list of works.
    sources: tuple[tuple[str, int], ...] = ()
    weights: tuple[float, ...] = ()

    @property
    def works_digest(self) -> str:
        if not self.sources:
            return works_digest(self.works)
        # The sources' boundaries are part of what workers must agree on; the weights are not
        # (they change while the queue runs: wq-sql mix).
        head = tuple(f"\x00wq_sql source {name} {n}" for name, n in self.sources)
        return works_digest(head + self.works)


def normalize_works(works: Sequence[Work]) -> tuple[str, ...]:
    """Validate and normalise works as DeepRec does: a non-empty list of str/bytes, each stripped.

    >>> normalize_works([b" a.txt ", "b.txt"])
    ('a.txt', 'b.txt')
    """
    if isinstance(works, (str, bytes)) or not isinstance(works, (list, tuple)):
        raise InvalidInput(f"works must be a list of str or bytes, got {type(works).__name__}")
    if not works:
        raise InvalidInput("works must be a non-empty list of str or bytes")
    out = []
    for i, w in enumerate(works):
        if isinstance(w, bytes):
            try:
                w = w.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InvalidInput(f"works[{i}] is not valid UTF-8 ({e}); pass str or UTF-8 bytes") from None
        elif not isinstance(w, str):
            raise InvalidInput(f"works[{i}] must be str or bytes, got {type(w).__name__}")
        w = w.strip()
        if "\x00" in w:
            raise InvalidInput(f"works[{i}] contains a NUL character, which neither backend can store")
        if not w:
            raise InvalidInput(f"works[{i}] is empty after stripping white space")
        check_text(f"works[{i}]", w)
        out.append(w)
    return tuple(out)


# A source name: what `wq-sql mix NAME --set web=0.5` and SQL filters spell.
_SOURCE_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,100}$")


def queue_spec(works: Union[Sequence[Work], Mapping[str, Sequence[Work]]],
               weights: Optional[Mapping[str, float]], num_epochs: object, shuffle: object, seed: object,
               num_slices: object, prefix: object) -> QueueSpec:
    """The checked configuration of a queue from ``WorkQueue``'s arguments: a list of works, or
    a dict of named sources (``weights``: their weights, default equal; see ``wq_sql.mixing``)."""
    common = (check_num_epochs(num_epochs), bool(shuffle), check_seed(seed), check_num_slices(num_slices),
              check_prefix(prefix))
    if not isinstance(works, Mapping):
        if weights is not None:
            raise InvalidInput("weights= needs named sources: pass works as a dict, e.g. "
                               "{'web': web_files, 'code': code_files}, weights={'web': 0.7, 'code': 0.3}")
        return QueueSpec(normalize_works(works), *common)
    names, lists = split_sources(works)
    flat = tuple(w for ws in lists for w in ws)
    return QueueSpec(flat, *common, sources=tuple(zip(names, map(len, lists))),
                     weights=check_weights(weights, names))


def split_sources(works: Mapping[str, Sequence[Work]]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """``{"web": [...], "code": [...]}`` → (the names in the order given, each source's works
    normalised). Each source must be a non-empty list of works."""
    if not isinstance(works, Mapping) or not works:
        raise InvalidInput("weighted works must be a non-empty dict of source name -> list of works")
    names, lists = [], []
    for name, ws in works.items():
        names.append(check_source_name(name))
        try:
            lists.append(normalize_works(ws))
        except InvalidInput as e:
            raise InvalidInput(f"source {name!r}: {e}") from None
    return tuple(names), lists


def check_source_name(name: object) -> str:
    if not isinstance(name, str) or not _SOURCE_NAME.match(name):
        raise InvalidInput(f"source name {name!r}: use 1 to 100 letters, digits, '_', '-' or '.'")
    return name


def check_weights(weights: object, names: Sequence[str]) -> tuple[float, ...]:
    """The weights of ``names``, in their order, from a mapping (or ``None``: all equal). Each
    must be a finite number >= 0, not all zero; a missing source weighs 0 only if named with 0:
    every source must be given, so that a typo is not a silent zero."""
    if weights is None:
        return tuple(1.0 / len(names) for _ in names)
    if not isinstance(weights, Mapping):
        raise InvalidInput(f"weights must be a dict of source name -> number, got {type(weights).__name__}")
    unknown = [k for k in weights if k not in names]
    if unknown:
        raise InvalidInput(f"weights name {', '.join(map(repr, unknown))}, which the queue does not have; "
                           f"its sources are {', '.join(map(repr, names))}")
    missing = [n for n in names if n not in weights]
    if missing:
        raise InvalidInput(f"weights give no weight to {', '.join(map(repr, missing))}; give every source "
                           "one (0 to leave a source out)")
    out = []
    for n in names:
        w = weights[n]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise InvalidInput(f"weight of {n!r} must be a finite number >= 0, got {w!r}")
        out.append(float(w))
    s = sum(out)
    if s <= 0:
        raise InvalidInput("weights are all zero: at least one source must have a weight above 0")
    return tuple(w / s for w in out)


def parse_weights(text: str) -> dict[str, float]:
    """``"web=0.5,code=0.4,math=0.1"`` → a dict (``check_weights`` checks it against a queue)."""
    check_text("weights", text)
    out: dict[str, float] = {}
    for part in text.split(","):
        name, eq, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name or not value:
            raise InvalidInput(f"weights {text!r}: write NAME=WEIGHT pairs separated by commas, "
                               "e.g. web=0.5,code=0.4,math=0.1")
        if name in out:
            raise InvalidInput(f"weights {text!r} name {name!r} twice")
        try:
            out[name] = float(value)
        except ValueError:
            raise InvalidInput(f"weight of {name!r} is not a number: {value!r}") from None
    return out


def check_text(what: str, text: str) -> None:
    """Refuse text that cannot be stored as UTF-8 (a lone surrogate, e.g. from a bad decode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"{what} must be valid Unicode text, got {text!r} (it holds a lone "
                           "surrogate); pass str decoded from UTF-8") from None


def check_num_epochs(num_epochs: object) -> int:
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1:
        raise InvalidInput(f"num_epochs must be a positive int, got {num_epochs!r}")
    if num_epochs > 2**62:
        raise InvalidInput(f"num_epochs must be at most 2**62, got {num_epochs}")
    return num_epochs


def check_num_slices(num_slices: object) -> Optional[int]:
    if num_slices is None:
        return None
    if isinstance(num_slices, bool) or not isinstance(num_slices, int) or not 1 <= num_slices <= 2**31 - 1:
        raise InvalidInput(f"num_slices must be None or an int from 1 to 2**31 - 1, got {num_slices!r}")
    return num_slices


def check_seed(seed: object) -> Optional[int]:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise InvalidInput(f"seed must be None or an int in [0, 2**63), got {seed!r}")
    return seed


def works_digest(works: Sequence[str]) -> str:
    """SHA-256 over the length-prefixed works, so joining compares 64 characters, not the list."""
    h = hashlib.sha256()
    for w in works:
        b = w.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def new_seed() -> int:
    return random.SystemRandom().randrange(2**62)


def epoch_order(n: int, epoch: int, shuffle: bool, seed: int, *,
                breathe: Optional[Callable[[], object]] = None) -> array[int]:
    """The work indexes of ``epoch`` in hand-out order (``order[seq] = work index``), as a
    compact ``array('i')`` (4 bytes per work instead of a list's ~36).

    A Fisher-Yates shuffle driven only by ``Random.random()`` seeded with an int, the one part of
    the ``random`` module whose output Python guarantees across versions and machines.

    ``breathe``: for a background thread, called after every ``SHUFFLE_SLICE`` swaps and every
    ``FILL_SLICE`` indexes of the initial array, to hand the GIL to the process's other threads
    (a million works are a long run of pure Python, and ``array("i", range(n))`` alone is one C
    call that holds the GIL throughout: no thread switch interrupts it).

    >>> list(epoch_order(4, 0, False, 7))
    [0, 1, 2, 3]
    >>> sorted(epoch_order(4, 1, True, 7))
    [0, 1, 2, 3]
    """
    # 32-bit indexes: 2**31 works would not fit in memory anyway.
    if breathe is None:
        order = array("i", range(n))
    else:
        order = array("i")
        for start in range(0, n, FILL_SLICE):
            order.extend(range(start, min(n, start + FILL_SLICE)))
            breathe()
    if not shuffle:
        return order
    rnd = random.Random(seed * 1_000_003 + epoch).random
    i = n - 1
    while i > 0:
        stop = max(0, i - SHUFFLE_SLICE)
        for k in range(i, stop, -1):
            j = int(rnd() * (k + 1))
            order[k], order[j] = order[j], order[k]
        i = stop
        if breathe is not None and i:
            breathe()
    return order


def cut(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous ranges ``[start, end)`` covering ``[0, n)`` exactly, sizes differing by at
    most one; needs ``1 <= k <= n`` so that no range is empty.

    >>> cut(10, 3)
    [(0, 3), (3, 6), (6, 10)]
    """
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} records into {k} non-empty ranges")
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def allocate(sizes: Sequence[Optional[int]], num_slices: Optional[int]) -> list[int]:
    """How many items each work becomes. ``sizes[i]`` is the work's record count (or bytes) for
    a sliceable work, ``None`` for a work that is handed out whole.

    - A whole work is one item; an empty sliceable work (size 0) is none.
    - ``num_slices=None``: every non-empty sliceable work is one item.
    - Otherwise ``num_slices`` is the total per epoch (DeepRec): every non-empty work gets one
      item, and the rest is spread in proportion to the sizes (largest remainders first), never
      more items than a work has records. When ``num_slices`` is smaller than the number of
      non-empty works, each of them is still one item (nothing is dropped); when the works have
      fewer records than ``num_slices``, every record is its own item.

    >>> allocate([90, 10, None, 0], 11)
    [9, 1, 1, 0]
    >>> allocate([3, 100], 100)
    [3, 97]
    """
    counts = [1 if s is None or s > 0 else 0 for s in sizes]
    if num_slices is None:
        return counts
    budget = num_slices - sum(1 for s in sizes if s is None)
    free = [i for i, s in enumerate(sizes) if s]
    while free and budget > len(free):
        total = sum(sizes[i] or 0 for i in free)
        # Exact quotas budget * size / total as (whole, remainder over total).
        quota = {i: divmod(budget * (sizes[i] or 0), total) for i in free}
        full = [i for i in free if quota[i][0] >= (sizes[i] or 0)]
        if full:  # a work with fewer records than its share: one item per record
            for i in full:
                counts[i] = sizes[i] or 0
                budget -= counts[i]
            free = [i for i in free if i not in full]
            continue
        for i in free:
            counts[i] = max(1, quota[i][0])
        # Closest to the quotas: add to the largest remainders, or take from the works most
        # above their quota (never below one item); ties by position, so every machine agrees.
        while (diff := budget - sum(counts[i] for i in free)) != 0:
            if diff > 0:
                ranked = sorted(free, key=lambda i: (counts[i] * total - budget * (sizes[i] or 0), i))
                for i in ranked[:diff]:
                    counts[i] += 1
            else:
                ranked = sorted((i for i in free if counts[i] > 1),
                                key=lambda i: (budget * (sizes[i] or 0) - counts[i] * total, i))
                for i in ranked[:-diff]:
                    counts[i] -= 1
        break
    return counts


@dataclass(frozen=True)
class PlannedItem:
    """One row of ``wq_works``: the item string and, for a slice, its bounds as JSON."""

    work: str
    bounds: Optional[str] = None
    of: int = 0  # the index of the given work it comes from (a slice: the work it cuts)


def slice_name(work: str, start: int, end: int) -> str:
    """The item string of one slice, in DeepRec's format: the work as given, then
    ``?start=<s>&end=<e>``, whatever the work holds (a ``?`` of its own included), so that
    :func:`unslice` finds it from the right.

    >>> slice_name("table:t", 0, 10)
    'table:t?start=0&end=10'
    >>> slice_name("table:t?key=id", 0, 10)
    'table:t?key=id?start=0&end=10'
    """
    return f"{work}?start={start}&end={end}"


_SLICE = re.compile(r"\?start=[0-9]+&end=[0-9]+\Z")
_OLD_SLICE = re.compile(r"&start=[0-9]+&end=[0-9]+\Z")


def unslice(item: str) -> str:
    """The work an item string was cut from (the inverse of :func:`slice_name`): the item
    without its last ``?start=<s>&end=<e>``.

    >>> unslice("lines:/data/what?.txt&a=1?start=0&end=55")
    'lines:/data/what?.txt&a=1'
    """
    m = _SLICE.search(item)
    if m:
        return item[:m.start()]
    # Queues created before this rule put "&start=" after a work that held a "?" already.
    return _OLD_SLICE.sub("", item) if "?" in item else item


# ---------------------------------------------------------------- arguments of a queue


def check_name(name: object) -> str:
    if isinstance(name, str) and "\x00" in name:
        raise InvalidInput("name contains a NUL character, which neither backend can store")
    if not isinstance(name, str) or not name or len(name) > 200:
        raise InvalidInput(f"name must be a non-empty str of at most 200 characters, got {name!r}")
    check_text("name", name)
    if not any(ch.isprintable() and not ch.isspace() for ch in name):
        # Spaces or invisible characters only: a blank row in `wq-sql ls`, and hard to type.
        raise InvalidInput(f"name must contain a visible character (not only spaces or invisible "
                           f"ones), got {name!r}")
    return name


def check_prefix(prefix: object) -> Optional[str]:
    if prefix is None:
        return None
    if isinstance(prefix, bytes):
        try:
            prefix = prefix.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidInput(f"prefix is not valid UTF-8 ({e}); pass str or UTF-8 bytes") from None
    if not isinstance(prefix, str) or "\x00" in prefix:
        raise InvalidInput(f"prefix must be None or a str without NUL, got {prefix!r}")
    check_text("prefix", prefix)
    return prefix


def check_positive(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidInput(f"{what} must be a positive number, got {value!r}")


def check_seconds(what: str, value: object) -> None:
    """A duration the database adds to its clock: positive and at most 1e9 s (31 years), so it
    stays a valid interval (Postgres) and timestamp (SQLite)."""
    check_positive(what, value)
    if not value <= 1e9:  # type: ignore[operator]
        raise InvalidInput(f"{what} must be at most 1e9 seconds (about 31 years), got {value!r}")


def check_count(what: str, value: object) -> None:
    """A count stored in a 32-bit INTEGER column."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**31 - 1:
        raise InvalidInput(f"{what} must be an int from 1 to 2**31 - 1, got {value!r}")


@dataclass(frozen=True)
class Options:
    """One worker's settings of a queue object (``WorkQueue``'s keywords of the same names),
    checked by :func:`check_options`; ``heartbeat_seconds`` is resolved to its default here."""

    lease_seconds: float
    lease_ahead: Optional[int]
    max_attempts: Optional[int]
    auto_complete: bool
    max_item_seconds: Optional[float]
    heartbeat_seconds: float
    poll_seconds: float
    busy_timeout: float
    schema: Optional[str]
    claim_ahead: bool
    run: Optional[tuple[str, int]] = None


def check_options(lease_seconds: float, lease_ahead: Optional[int], max_attempts: Optional[int],
                  auto_complete: bool, max_item_seconds: Optional[float],
                  heartbeat_seconds: Optional[float], poll_seconds: float, busy_timeout: float,
                  schema: Optional[str], claim_ahead: bool,
                  run: Optional[tuple[str, int]] = None) -> Options:
    check_seconds("lease_seconds", lease_seconds)
    check_positive("busy_timeout", busy_timeout)
    check_positive("poll_seconds", poll_seconds)
    if lease_ahead is not None:
        check_count("lease_ahead", lease_ahead)
    if max_attempts is not None:
        check_count("max_attempts", max_attempts)
    for what, seconds in (("max_item_seconds", max_item_seconds), ("heartbeat_seconds", heartbeat_seconds)):
        if seconds is not None:
            check_seconds(what, seconds)
    beat = float(heartbeat_seconds if heartbeat_seconds is not None else min(lease_seconds / 6.0, 5.0))
    if beat * 2 > lease_seconds:
        raise InvalidInput("heartbeat_seconds must be at most half of lease_seconds, or leases "
                           "of live workers would expire between two heartbeats")
    if run is not None:
        run = check_run(run)
    return Options(float(lease_seconds), lease_ahead, max_attempts, bool(auto_complete), max_item_seconds,
                   beat, float(poll_seconds), float(busy_timeout), schema, bool(claim_ahead), run)


def check_run(run: object) -> tuple[str, int]:
    """``run=(run id, restart count)``: the job run a worker belongs to (torchrun's
    ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT``)."""
    if (not isinstance(run, (tuple, list)) or len(run) != 2 or not isinstance(run[0], str)
            or not 1 <= len(run[0]) <= 200 or isinstance(run[1], bool) or not isinstance(run[1], int)
            or not 0 <= run[1] <= 2**31 - 1):
        raise InvalidInput(f"run must be (run id: a str of 1 to 200 characters, restart count: an int "
                           f">= 0), e.g. (os.environ['TORCHELASTIC_RUN_ID'], "
                           f"int(os.environ['TORCHELASTIC_RESTART_COUNT'])); got {run!r}")
    return (run[0], int(run[1]))


T = TypeVar("T")


class Part(Generic[T]):
    """A read-only attribute that an object keeps in one of its parts, named by the part's
    attribute: ``WorkQueue``'s settings (``Options``) and its stored queue row."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> T:
        if obj is None:
            return self  # type: ignore[return-value]
        value: T = getattr(getattr(obj, self.part), self.name)
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(f"{self.name} is read-only: pass it when constructing the object")
