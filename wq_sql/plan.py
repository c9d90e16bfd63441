"""Pure functions that decide what the rows of a queue are: validation, the config digest,
the per-epoch shuffle, and slicing. No database access here.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

from wq_sql.errors import InvalidInput

Work = Union[str, bytes]


@dataclass(frozen=True)
class QueueSpec:
    """The configuration every worker must agree on (``prefix`` excepted: data may move)."""

    works: tuple[str, ...]
    num_epochs: int
    shuffle: bool
    seed: Optional[int]
    num_slices: Optional[int]
    prefix: Optional[str]

    @property
    def works_digest(self) -> str:
        return works_digest(self.works)


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
        out.append(w)
    return tuple(out)


def check_num_epochs(num_epochs: object) -> int:
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1:
        raise InvalidInput(f"num_epochs must be a positive int, got {num_epochs!r}")
    if num_epochs > 2**62:
        raise InvalidInput(f"num_epochs must be at most 2**62, got {num_epochs}")
    return num_epochs


def check_num_slices(num_slices: object) -> Optional[int]:
    if num_slices is None:
        return None
    if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
        raise InvalidInput(f"num_slices must be None or a positive int, got {num_slices!r}")
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


def epoch_order(n: int, epoch: int, shuffle: bool, seed: int) -> list[int]:
    """The work indexes of ``epoch`` in hand-out order (``order[seq] = work index``).

    A Fisher-Yates shuffle driven only by ``Random.random()`` seeded with an int, the one part of
    the ``random`` module whose output Python guarantees across versions and machines.

    >>> epoch_order(4, 0, False, 7)
    [0, 1, 2, 3]
    >>> sorted(epoch_order(4, 1, True, 7))
    [0, 1, 2, 3]
    """
    order = list(range(n))
    if not shuffle:
        return order
    rnd = random.Random(seed * 1_000_003 + epoch).random
    for i in range(n - 1, 0, -1):
        j = int(rnd() * (i + 1))
        order[i], order[j] = order[j], order[i]
    return order


def slice_works(works: tuple[str, ...], num_slices: Optional[int]) -> tuple[str, ...]:
    """The items of one epoch. Plain file paths cannot be counted, so they stay whole
    (DeepRec: "num_slices is invalid when reading files"); sliceable sources plug in here."""
    return works
