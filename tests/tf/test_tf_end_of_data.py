"""The end of data under load (issue 13): two TF worker processes run the simplest pipeline on
one queue beside two CPU burners, a few times per backend, under a hang detector that dumps
every worker's stacks. ``make stress`` runs many more rounds (``stress_end_of_data.py``); the
interleaving itself is forced deterministically in ``tests/contract/test_waits.py`` and
``test_tf_sync.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from procwatch import burners  # noqa: E402
from stress_end_of_data import one_run  # noqa: E402

ROUNDS = 2


@pytest.mark.slow
def test_two_workers_end_together_beside_busy_cores(db_url: str, tmp_path: Path) -> None:
    with burners(2, seconds=600):
        for _ in range(ROUNDS):
            one_run(db_url, tmp_path, hang=90)  # raises Hung with every worker's stacks
