"""Records/s of ``TextLineDataset(wq.input_dataset())`` against plain ``TextLineDataset(files)``,
measured alternately in the same run (issue 3's target: at least 0.9x).

    .venv/bin/python bench/tf_textline.py                          # SQLite, 1,000 files x 100 lines
    .venv/bin/python bench/tf_textline.py --lease-ahead 1 16 64 --runs 7
    .venv/bin/python bench/tf_textline.py --url postgresql://postgres@127.0.0.1:5432/postgres
    .venv/bin/python bench/tf_textline.py --lease-ahead default --json out.json   # the shim's defaults

Each run reads every line once, batched (``--batch``, as a training input pipeline would), and
times from the first pull to the end of the stream (the pull that raises ``StopIteration``);
setting up the queue (inserting the works) is not timed, and neither is deleting the iterator
after it, which is printed on its own ("teardown"): in TensorFlow 2.21 a finished iterator's
destructor waits, in many runs of either side (here 30-45% of the plain runs, 0-20% of wq_sql's,
varying from session to session), for tf.data's autotuner thread
to wake at its next optimization tick, 10 * (2**k - 1) ms after the iterator was made (0.31,
0.63, 1.27, 2.55 s...): the cancellation's wake-up reaches that thread before
``CancellationManager::IsCancelled()`` turns true (it is set only after the callbacks ran), so
the thread sleeps on. Timed with the loop, that wait made both sides bimodal (the "slow mode":
runs ending at exactly those ticks, e.g. both 1,000-line medians at 2.56 s in the 12:14 UTC
headline run of 2026-11-26); it is paid once per iterator, not per record, and is no part of
either pipeline. Every wq_sql run uses a fresh queue (a new name, dropped afterwards). Reported:
the median seconds of each side over ``--runs`` runs and ratio = median(plain) / median(wq_sql)
(records/s of wq_sql over records/s of plain), the verdict; the ratio of the fastest runs; and
the teardowns' median and longest. The machines here are shared: read ratios, not absolute
numbers.

``--burner DUTY`` adds a third side as a yardstick: plain ``TextLineDataset(files)`` while a
thread that holds no lock (SHA-256 in C, which releases the GIL) keeps DUTY of one core busy in
0.6 ms bursts, i.e. the CPU that wq_sql's claim-ahead thread spends beside the pipeline, without
any database. ``--structure`` adds another: ``input_dataset``'s own pipeline (the same ops and
hand-out size) fed from a Python list, i.e. what its shape costs without the queue.
``--floor N`` adds a floor: plain ``TextLineDataset(files)`` while a thread runs only the
durable statements wq_sql makes for the same number of items (``_common.DurableRounds``: claim
rounds of N, each marking the previous round done with its history rows and counters, by the raw
driver), timed until both have ended: what any pipeline that claims and completes every file
durably costs at least on this machine, so plain / floor bounds the ratio reachable here.
``--no-autotune`` turns tf.data's autotuner off on every side (the pipelines' own costs,
compared without it; no teardown wait either).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _common import DurableRounds, floor_queue  # noqa: E402

import wq_sql  # noqa: E402
from wq_sql.tf import WorkQueue  # noqa: E402


def write_files(directory: Path, n_files: int, n_lines: int) -> list[str]:
    paths = []
    for i in range(n_files):
        path = directory / f"part-{i:05d}.txt"
        path.write_text("".join(f"{i},{j},{(i * 31 + j) % 97},some payload text\n" for j in range(n_lines)))
        paths.append(str(path))
    return paths


AUTOTUNE = True  # --no-autotune: both sides without tf.data's autotuner


TEARDOWNS: list[float] = []  # seconds to delete each timed iterator (see the module docstring)


def consume(ds: tf.data.Dataset) -> tuple[int, float]:
    """Records read and seconds from the first pull to the end of the stream; the iterator's
    deletion after it goes to TEARDOWNS."""
    if not AUTOTUNE:
        options = tf.data.Options()
        options.autotune.enabled = False
        ds = ds.with_options(options)
    start = time.perf_counter()
    n = 0
    iterator = iter(ds)
    for batch in iterator:
        n += int(batch.shape[0])
    seconds = time.perf_counter() - start
    end = time.perf_counter()
    del iterator
    TEARDOWNS.append(time.perf_counter() - end)
    return n, seconds


def run_plain(paths: list[str], batch: int) -> tuple[int, float]:
    return consume(tf.data.TextLineDataset(paths).batch(batch))


def run_plain_burning(paths: list[str], batch: int, duty: float) -> tuple[int, float]:
    stop = threading.Event()
    block = b"x" * 20_000

    def burn() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < 0.0006:
                hashlib.sha256(block).digest()
            time.sleep(0.0006 * (1 - duty) / duty)

    thread = threading.Thread(target=burn, daemon=True)
    thread.start()
    try:
        return run_plain(paths, batch)
    finally:
        stop.set()
        thread.join()


def run_structure(paths: list[str], batch: int, lease_ahead: Optional[int]) -> tuple[int, float]:
    """input_dataset's pipeline (the same ops, hand-outs of the same size) fed from a Python
    list instead of the queue: what the pipeline's shape costs, without any database."""
    works = [p.encode("utf-8") for p in paths]
    k = max(1, ((lease_ahead or 1) + 1) // 2)
    at = [0]

    def next_many() -> np.ndarray:
        i = at[0]
        at[0] = i + k
        return np.array(works[i:i + k], dtype=object)

    def take(_: tf.Tensor) -> tf.Tensor:
        got = tf.numpy_function(next_many, [], tf.string, stateful=True)
        got.set_shape([None])
        return got

    names = (tf.data.Dataset.from_tensors(0).repeat().map(take)
             .take_while(lambda got: tf.size(got) > 0).unbatch())
    return consume(tf.data.TextLineDataset(names).batch(batch))


def run_floor(paths: list[str], batch: int, url: str, n: int) -> tuple[int, float]:
    """``--floor``: plain reading beside a thread that only claims and completes as many items in
    rounds of ``n`` (the queue and its worker row made first, not timed)."""
    name = f"floor_{uuid.uuid4().hex[:8]}"
    qid, ids = floor_queue(paths, url, name, 1)
    rounds = DurableRounds(url, qid, ids[0], n)
    drained: list[tuple[int, float]] = []  # (items, when the last round ended)

    def drain() -> None:
        n = sum(1 for _ in rounds.drain())
        drained.append((n, time.perf_counter()))

    thread = threading.Thread(target=drain, name="floor-rounds")
    start = time.perf_counter()
    thread.start()
    try:
        got, seconds = consume(tf.data.TextLineDataset(paths).batch(batch))
    finally:
        thread.join()
        wq_sql.drop_queue(name, url)
    assert drained and drained[0][0] == len(paths), drained
    return got, max(seconds, drained[0][1] - start)


WAITS: list[tuple[float, float, int]] = []  # per wq_sql run: (s in hand-outs, s in the last one, hand-outs)


def run_wq(paths: list[str], batch: int, url: str, lease_ahead: Optional[int]) -> tuple[int, float]:
    """``lease_ahead=None``: the shim's default settings (no ``lease_ahead=`` passed). The time
    the pipeline spent inside the shim's hand-outs (the Python call its numpy_function makes,
    waiting for a claim round when the buffer is empty) goes to WAITS: a part of the gap that is
    wq_sql's for certain, measured directly rather than as the difference of two noisy times."""
    name = f"bench_{uuid.uuid4().hex[:8]}"
    knobs: dict[str, Any] = {} if lease_ahead is None else {"lease_ahead": lease_ahead}
    wq = WorkQueue(paths, shuffle=False, name=name, url=url, worker="bench", **knobs)
    spent: list[float] = []
    hand_out = wq._next_many

    def timed(*args: Any) -> np.ndarray:
        t = time.perf_counter()
        try:
            return hand_out(*args)
        finally:
            spent.append(time.perf_counter() - t)

    wq._next_many = timed  # type: ignore[method-assign]  # read by input_dataset()'s take
    try:
        n, seconds = consume(tf.data.TextLineDataset(wq.input_dataset()).batch(batch))
    finally:
        wq.close()
        wq_sql.drop_queue(name, url)
    WAITS.append((sum(spent), spent[-1] if spent else 0.0, len(spent)))
    return n, seconds


def run_batches(paths: list[str], batch: int, url: str, lineage: bool) -> tuple[int, float]:
    """``wq.batches(TextLineDataset, batch)`` at the shim's defaults, with or without lineage
    (each batch's records recorded): what lineage costs, against the same pipeline without it."""
    name = f"bench_{uuid.uuid4().hex[:8]}"
    wq = WorkQueue(paths, shuffle=False, name=name, url=url, worker="bench", lineage=lineage)
    try:
        n, seconds = consume(wq.batches(tf.data.TextLineDataset, batch))
    finally:
        wq.close()
        wq_sql.drop_queue(name, url)
    return n, seconds


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPUs, load {load:.2f}, "
            f"Python {platform.python_version()}, TensorFlow {tf.__version__}")


def _lease_ahead(text: str) -> Optional[int]:
    if text == "default":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive integer or 'default'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive integer or 'default'")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None,
                    help="database URL (default: a fresh SQLite file in a temp dir)")
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--lines", type=int, default=100, help="lines per file")
    ap.add_argument("--lease-ahead", type=_lease_ahead, nargs="+", default=[1, 16],
                    help="one or more values; 'default' = the shim's default settings (nothing passed)")
    ap.add_argument("--runs", type=int, default=5, help="runs per side (medians are reported)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--burner", type=float, default=None, metavar="DUTY",
                    help="also time plain reading beside a GIL-free busy thread of this duty (0-1)")
    ap.add_argument("--structure", action="store_true",
                    help="also time input_dataset's pipeline fed from a Python list (no database)")
    ap.add_argument("--floor", type=int, default=0, metavar="N",
                    help="also time plain reading beside only the durable statements, in rounds of N")
    ap.add_argument("--no-autotune", action="store_true",
                    help="both sides with tf.data's autotuner off (no bimodal slow mode)")
    ap.add_argument("--lineage", action="store_true",
                    help="also time wq.batches(TextLineDataset, batch) without and with lineage=True")
    ap.add_argument("--json", default=None, help="also write every run's seconds and the ratios here")
    args = ap.parse_args()
    global AUTOTUNE
    AUTOTUNE = not args.no_autotune

    with tempfile.TemporaryDirectory(prefix="wq_sql_bench_tf_") as tmp:
        paths = write_files(Path(tmp), args.files, args.lines)
        url = args.url or f"sqlite:///{tmp}/wq.db"
        expected = args.files * args.lines
        print(machine())
        print(f"{args.files} files x {args.lines} lines, batch {args.batch}, {args.runs} runs per side, "
              f"backend {url.split(':', 1)[0]}{', autotune off' if args.no_autotune else ''}")
        run_plain(paths, args.batch)  # warm up TensorFlow and the page cache
        run_wq(paths, args.batch, url, args.lease_ahead[0])
        results: list[dict[str, Any]] = []
        for lease_ahead in args.lease_ahead:
            plain, ours, burning, shaped, floor, bare, traced = [], [], [], [], [], [], []
            plain_td, ours_td = [], []
            del WAITS[:]
            for _ in range(args.runs):
                n, s = run_plain(paths, args.batch)
                assert n == expected, (n, expected)
                plain.append(s)
                plain_td.append(TEARDOWNS[-1])
                n, s = run_wq(paths, args.batch, url, lease_ahead)
                assert n == expected, (n, expected)
                ours.append(s)
                ours_td.append(TEARDOWNS[-1])
                if args.burner:
                    n, s = run_plain_burning(paths, args.batch, args.burner)
                    assert n == expected, (n, expected)
                    burning.append(s)
                if args.floor:
                    n, s = run_floor(paths, args.batch, url, args.floor)
                    assert n == expected, (n, expected)
                    floor.append(s)
                if args.structure:
                    n, s = run_structure(paths, args.batch, lease_ahead)
                    assert n == expected, (n, expected)
                    shaped.append(s)
                if args.lineage:
                    for with_lineage, into in ((False, bare), (True, traced)):
                        n, s = run_batches(paths, args.batch, url, with_lineage)
                        assert n == expected, (n, expected)
                        into.append(s)
            p, o = statistics.median(plain), statistics.median(ours)
            shown = "default" if lease_ahead is None else str(lease_ahead)
            line = (f"lease_ahead={shown:<3s} plain {p:.3f}s ({expected / p:,.0f} rec/s)  "
                    f"wq_sql {o:.3f}s ({expected / o:,.0f} rec/s)  ratio {p / o:.2f}x  "
                    f"[{'meets' if p / o >= 0.9 else 'below'} 0.9x]  best runs {min(plain) / min(ours):.2f}x")
            if shaped:
                line += (f"  | the same pipeline from a list: {p / statistics.median(shaped):.2f}x "
                         f"(best {min(plain) / min(shaped):.2f}x)")
            if floor:
                line += (f"  | floor (plain + the durable statements, rounds of {args.floor}): "
                         f"{p / statistics.median(floor):.2f}x (best {min(plain) / min(floor):.2f}x)")
            if traced:
                b, t = statistics.median(bare), statistics.median(traced)
                line += (f"  | wq.batches() {p / b:.2f}x of plain, with lineage {p / t:.2f}x; lineage against "
                         f"without, same run: {b / t:.3f}x (best runs {min(bare) / min(traced):.3f}x)")
            if burning:
                line += (f"  | plain beside a {args.burner:.0%} burner: {p / statistics.median(burning):.2f}x "
                         f"(best {min(plain) / min(burning):.2f}x)")
            line += (f"  | inside hand-outs {statistics.median(w[0] for w in WAITS) * 1e3:.1f} ms per pass "
                     f"(the last, which learns the end, {statistics.median(w[1] for w in WAITS) * 1e3:.1f}; "
                     f"{statistics.median(w[2] for w in WAITS):.0f} hand-outs)")
            line += (f"  | iterator teardown (not timed) plain {statistics.median(plain_td) * 1e3:.0f} ms "
                     f"(longest {max(plain_td) * 1e3:.0f}), wq_sql {statistics.median(ours_td) * 1e3:.0f} ms "
                     f"(longest {max(ours_td) * 1e3:.0f})")
            print(line, flush=True)
            results.append({"backend": url.split(":", 1)[0].split("+")[0], "files": args.files,
                            "lines": args.lines, "lease_ahead": shown, "autotune": AUTOTUNE,
                            "plain_s": plain, "wq_sql_s": ours,
                            "plain_teardown_s": plain_td, "wq_sql_teardown_s": ours_td, "burner_s": burning, "structure_s": shaped,
                            "floor_s": floor, "floor_n": args.floor, "batches_s": bare,
                            "batches_lineage_s": traced,
                            "handout_s": [w[0] for w in WAITS], "last_handout_s": [w[1] for w in WAITS],
                            "handouts": [w[2] for w in WAITS],
                            "ratio": p / o, "best_ratio": min(plain) / min(ours),
                            "load": os.getloadavg()[0]})
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
