"""Pure rules of a queue built from weighted sources: what the weights mean, how many items of
each source an epoch (or the rest of one) draws, which of a source's items those are, and in
what order the sources alternate. No database access here (``wq_sql.store.mixing`` writes it).

- **An epoch** draws as many items as the sources hold together (``total``); source ``s`` gets
  ``counts(total, weights)[s]`` of them: its share of the total, rounded by largest remainder.
- **A source's stream**: its items in cycles, each cycle a permutation of all of them
  (``plan.epoch_order`` seeded per source and cycle; in order without ``shuffle``). Draws take
  the stream's next positions, epoch after epoch, so every item of a source is drawn once
  before any is drawn again: a source smaller than its share repeats (upsampled), a larger one
  is subsampled and continues where it stopped in the next epoch.
- **The order**: the draws of all sources interleaved evenly (``interleave``), so that any run
  of consecutive hand-outs holds each source at its weight, within one item per source.

Everything is deterministic from the queue's seed and the stream positions already drawn.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

from wq_sql.plan import epoch_order


@dataclass(frozen=True)
class Source:
    """One source of a weighted queue: its works are ``wq_works`` rows ``first .. first + n - 1``
    (after slicing), ``drawn`` its stream's next position, ``skip`` positions at or after it
    that item rows already hold (after a mix change gave back positions below rows it kept)."""

    idx: int
    name: str
    first: int
    n: int
    weight: float
    drawn: int = 0
    skip: tuple[int, ...] = ()


def counts(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` draws shared by ``weights`` (summing to 1): each its floor, then the largest
    remainders one more each (ties: the earlier source). Sums to ``total`` exactly.

    >>> counts(10, [0.6, 0.3, 0.1])
    [6, 3, 1]
    >>> counts(7, [0.5, 0.5, 0.0])
    [4, 3, 0]
    """
    exact = [total * w for w in weights]
    out = [int(math.floor(x)) for x in exact]
    rest = total - sum(out)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[:rest]:
        out[i] += 1
    return out


def interleave(counts_: Sequence[int], seed: int, epoch: int, start: int = 0) -> list[int]:
    """The source of each hand-out position: ``counts_[s]`` positions for source ``s``, spread
    evenly (the ``j``-th draw of ``s`` at key ``(j + u_s) / counts_[s]``, ``u_s`` seeded in
    ``(0, 1)``, ties by source), so any window of positions holds each source at its share within
    one draw. ``start``: the seq the run begins at (a redraw of an epoch's rest).

    >>> interleave([2, 1], seed=1, epoch=0)
    [0, 1, 0]
    """
    rnd = random.Random(f"wq_sql.mix {seed} {epoch} {start}")
    keys: list[tuple[float, int]] = []
    for s, c in enumerate(counts_):
        u = rnd.uniform(0.05, 0.95)
        keys.extend(((j + u) / c, s) for j in range(c))
    keys.sort()
    return [s for _, s in keys]


class Streams:
    """Stream positions → work indexes, for one queue's sources (permutations computed once per
    (source, cycle) and kept for the call's lifetime)."""

    def __init__(self, sources: Sequence[Source], shuffle: bool, seed: int) -> None:
        self.sources, self.shuffle, self.seed = list(sources), shuffle, seed
        self._perms: dict[tuple[int, int], Sequence[int]] = {}

    def work_of(self, s: int, pos: int) -> int:
        src = self.sources[s]
        cycle, k = divmod(pos, src.n)
        perm = self._perms.get((s, cycle))
        if perm is None:
            if len(self._perms) > 64:
                self._perms.clear()
            perm = self._perms[(s, cycle)] = epoch_order(src.n, cycle, self.shuffle,
                                                         (self.seed * 7919 + 104_729 * (s + 1)) % 2**62)
        return src.first + perm[k]


@dataclass
class Draws:
    """The rows of one run of hand-out positions: per position its work index, source and
    stream position; ``cursor`` each source's next stream position after it."""

    works: list[int]
    sources: list[int]
    positions: list[int]
    cursor: list[int]


def draw(streams: Streams, cursor: Sequence[int], weights: Sequence[float], total: int, seed: int,
         epoch: int, start: int = 0, taken: Optional[Sequence[Iterable[int]]] = None) -> Draws:
    """``total`` hand-out positions from ``start`` on, drawn at ``weights`` from each source's
    stream at ``cursor``, skipping the positions in ``taken[s]`` (held by rows that stay: after a
    mix change gave back a run of positions below others kept). A source whose weight is 0
    draws nothing; its cursor stays."""
    per = counts(total, weights)
    order = interleave(per, seed, epoch, start)
    cur = list(cursor)
    held = [set(t) for t in taken] if taken is not None else [set() for _ in cursor]
    picks: list[list[int]] = []
    for s, c in enumerate(per):
        got: list[int] = []
        p = cur[s]
        while len(got) < c:
            if p not in held[s]:
                got.append(p)
            p += 1
        cur[s] = p
        picks.append(got)
    nxt = [0] * len(per)
    works, srcs, poss = [], [], []
    for s in order:
        pos = picks[s][nxt[s]]
        nxt[s] += 1
        works.append(streams.work_of(s, pos))
        srcs.append(s)
        poss.append(pos)
    return Draws(works, srcs, poss, cur)
