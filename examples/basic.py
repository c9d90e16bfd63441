"""The core API in one page: create a queue, take items, settle each one explicitly, audit with SQL.

    python examples/basic.py                      # a throwaway SQLite file
    python examples/basic.py --url postgresql://user@host/db

With ``auto_complete=False`` nothing is done until you say so: ``complete`` marks an item done,
``release`` gives it back without counting an attempt, ``fail`` counts a failed attempt (after
``max_attempts`` the item is ``failed``, never silently dropped). The default,
``auto_complete=True``, is DeepRec's: an item is done when its worker takes the next one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Optional

from sqlalchemy import create_engine, text

import wq_sql
from wq_sql import QueueExhausted, WorkQueue
from wq_sql.store.engine import resolve_url
from wq_sql.store.redact import safe_url

QUEUE = "basic"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="database URL (default: a SQLite file in a temporary folder)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url or f"sqlite:///{Path(tmp) / 'basic.db'}"
        wq_sql.drop_queue(QUEUE, url)  # start over on a shared database
        run(url)
        audit(url)
    return 0


def run(url: str) -> None:
    works = ["a.txt", "b.txt", "c.txt", "d.txt"]
    print(f"create queue {QUEUE!r} of {works} in {safe_url(resolve_url(url))}")
    # lease_ahead=1, claim_ahead=False: one item per round trip and none claimed ahead, so a
    # released or failed item is the next one this worker takes. By default a worker claims
    # ahead (as many items as cover ~0.1 s of its work) and hands out what it holds first.
    with WorkQueue(works, num_epochs=1, shuffle=False, name=QUEUE, url=url, worker="worker-0",
                   auto_complete=False, max_attempts=2, lease_ahead=1, claim_ahead=False) as wq:
        item = wq.take()
        wq.complete(item)
        print(f"took {item!r} (epoch {item.epoch}, seq {item.seq}) -> complete: done")

        item = wq.take()
        wq.release(item)
        print(f"took {item!r} -> release: back to the queue, no attempt counted")

        item = wq.take()  # the released item again: claims go in (epoch, seq) order
        wq.fail(item, "bad record at line 3")
        print(f"took {item!r} again -> fail: attempt {item.attempts + 1} of {wq.max_attempts}, "
              "back to the queue")

        item = wq.take()
        wq.fail(item, "bad record at line 3")
        print(f"took {item!r} again -> fail: attempt {item.attempts + 1} of {wq.max_attempts}, now failed")

        for item in wq:  # iterating stops at the end of the queue
            wq.complete(item)
            print(f"took {item!r} -> complete: done")

        try:
            wq.take()
        except QueueExhausted as e:
            print(f"take() -> QueueExhausted: {e}")


def audit(url: str) -> None:
    engine = create_engine(resolve_url(url))
    with engine.connect() as c:
        for sql in ("SELECT seq, work, worker, state, attempts, last_error FROM wq_audit "
                    "WHERE queue = 'basic' ORDER BY seq",
                    "SELECT seq, kind, worker, detail FROM wq_history WHERE queue = 'basic' "
                    "ORDER BY event_id"):
            result = c.execute(text(sql))
            rows = [[("-" if v is None else str(v)) for v in r] for r in result]
            print(f"\n{sql}")
            print_table(list(result.keys()), rows)
    engine.dispose()


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(x) for x in col) for col in zip(headers, *rows)]
    for r in [headers, *rows]:
        print("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    sys.exit(main())
