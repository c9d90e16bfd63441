"""The contract: what every backend must pass. Every test in this folder that takes ``backend``
runs on SQLite, on Postgres and on Postgres through PgBouncer in transaction mode (a small
server pool), whatever its file: a new test here is shared by every backend by default.

Claims, leases and fencing, crashes, epochs, waits and the doorbell, sliced reads, heartbeat
renewals, chaos runs, the lease-ahead bound.
"""

from __future__ import annotations

import pytest
from backends import BACKENDS, POOLED, parametrize_backends


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_backends(metafunc, BACKENDS + [POOLED])
