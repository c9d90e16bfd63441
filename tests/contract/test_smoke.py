"""DeepRec's own WorkQueue cases, on both backends."""

from __future__ import annotations

import pytest

from wq_sql import InvalidInput, QueueExhausted, WorkQueue

WORKS = ["to", "be", "or", "not", "to", "be"]


def test_simple_in_order(db_url: str) -> None:
    with WorkQueue(WORKS, num_epochs=3, shuffle=False, url=db_url, worker="w") as wq:
        got = [wq.take() for _ in range(18)]
        with pytest.raises(QueueExhausted):
            wq.take()
    assert got == WORKS * 3


def test_shuffle_is_a_permutation_per_epoch(db_url: str) -> None:
    with WorkQueue(WORKS, num_epochs=3, shuffle=True, seed=11, url=db_url, worker="w") as wq:
        got = list(wq)
    epochs = [got[i * 6:(i + 1) * 6] for i in range(3)]
    assert all(sorted(e) == sorted(WORKS) for e in epochs)
    assert got != WORKS * 3


@pytest.mark.parametrize("works", [[], "a.txt", [1], [b"\xff"], ["a\x00b"]])
def test_bad_works(db_url: str, works: object) -> None:
    with pytest.raises(ValueError):
        WorkQueue(works, url=db_url, worker="w")  # type: ignore[arg-type]


@pytest.mark.parametrize("num_epochs", [0, -1, 1.5, "2", True])
def test_bad_num_epochs(db_url: str, num_epochs: object) -> None:
    with pytest.raises(InvalidInput, match="num_epochs"):
        WorkQueue(WORKS, num_epochs=num_epochs, url=db_url, worker="w")  # type: ignore[arg-type]
