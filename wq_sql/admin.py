"""Operations on whole queues and on the schema, for scripts and the ``wq-sql`` command."""

from __future__ import annotations

import getpass
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

from sqlalchemy.engine import URL

from wq_sql.errors import InvalidInput, QueueConfigMismatch, QueueNotFound
from wq_sql.mixing import Source
from wq_sql.plan import (
    Work,
    check_count,
    check_name,
    check_num_epochs,
    check_text,
    new_seed,
    parse_weights,
    queue_spec,
)
from wq_sql.sources import plan_items
from wq_sql.store import lineage as lineage_store
from wq_sql.store import migrate, mixing, notify, statements
from wq_sql.store import quarantine as quarantine_store
from wq_sql.store.dialects import dialect_of
from wq_sql.store.engine import make_engine, opening, resolve_url
from wq_sql.worker.joining import DEFAULT_MAX_ATTEMPTS, differences, extend_to


def _engine(url: Optional[str | URL], schema: Optional[str]) -> Any:
    return make_engine(resolve_url(url), schema=schema, pool_size=1)


def _lookup_name(name: object) -> str:
    """A queue name to look up: a str the database can store (a lone surrogate, say from
    undecodable bytes, would fail in the driver with a UnicodeEncodeError)."""
    if not isinstance(name, str):
        raise InvalidInput(f"name must be a str, got {type(name).__name__}")
    check_text("name", name)
    return name


@contextmanager
def _queue_tx(name: str, url: Optional[str | URL], schema: Optional[str],
              must_exist: bool = True, ring: bool = False) -> Iterator[tuple[Any, Any]]:
    """One write transaction on the schema-checked database, with queue ``name``'s row (``None``
    if there is none and not ``must_exist``). ``ring``: once it committed, the queue's waiting
    workers are woken (``notify.ring``) to look again."""
    name = _lookup_name(name)
    engine = _engine(url, schema)
    try:
        with opening(engine.url):
            migrate.ensure_schema(engine, schema)
            with engine.begin() as conn:
                row = statements.find_queue(conn, name)
                if row is None and must_exist:
                    raise QueueNotFound(f"no queue named {name!r}")
                yield conn, row
            if ring and row is not None:
                notify.ring(engine, row.id)
    finally:
        engine.dispose()


@contextmanager
def _queue_read(name: str, url: Optional[str | URL], schema: Optional[str]) -> Iterator[tuple[Any, Any]]:
    """A connection to the schema-checked database, with queue ``name``'s row (``QueueNotFound``
    if there is none): the reads of the operator verbs."""
    name = _lookup_name(name)
    engine = _engine(url, schema)
    try:
        with opening(engine.url):
            migrate.ensure_schema(engine, schema)
        with opening(engine.url), engine.connect() as conn:
            row = statements.find_queue(conn, name)
            if row is None:
                raise QueueNotFound(f"no queue named {name!r}")
            yield conn, row
    finally:
        engine.dispose()


def upgrade(url: Optional[str | URL] = None, schema: Optional[str] = None) -> str:
    """Create or upgrade the wq_sql schema; returns the revision it is now at."""
    engine = _engine(url, schema)
    try:
        with opening(engine.url):
            return migrate.upgrade(engine, schema)
    finally:
        engine.dispose()


def current(url: Optional[str | URL] = None, schema: Optional[str] = None) -> Optional[str]:
    engine = _engine(url, schema)
    try:
        with opening(engine.url), engine.connect() as conn:
            return migrate.current_revision(conn, schema)
    finally:
        engine.dispose()


def create_queue(works: Sequence[Work] | Mapping[str, Sequence[Work]], num_epochs: int = 1,
                 shuffle: bool = True, seed: Optional[int] = None, prefix: Optional[str] = None,
                 num_slices: Optional[int] = None, name: str = "work_queue", *,
                 url: Optional[str | URL] = None, max_attempts: Optional[int] = None,
                 schema: Optional[str] = None,
                 weights: Optional[Mapping[str, float]] = None) -> tuple[bool, Any]:
    """Create a queue ahead of the job, without joining it as a worker; the arguments and their
    validation are ``WorkQueue``'s. Returns ``(created, queue row)``: ``created`` is False when a
    queue of that name exists with the same configuration (as a joining worker would accept it);
    another configuration raises :class:`QueueConfigMismatch`, as ``WorkQueue(...)`` does.

    Example: ``create_queue(["a.txt", "b.txt"], num_epochs=2, seed=7, name="train",
    url="sqlite:///q.db")``.
    """
    name = _lookup_name(check_name(name))
    spec = queue_spec(works, weights, num_epochs, shuffle, seed, num_slices, prefix)
    if max_attempts is not None:
        check_count("max_attempts", max_attempts)  # an INTEGER column, as num_slices (checked above)
    engine = _engine(url, schema)
    try:
        b = dialect_of(engine)
        with opening(engine.url):
            migrate.ensure_schema(engine, schema)
            with engine.connect() as conn:
                exists = statements.find_queue(conn.execution_options(wq_read=True), name) is not None
        # Counting sliced works reads their sources: outside the short transaction that inserts
        # (and outside opening(): a source may be in another database).
        items = None if exists else plan_items(spec.works, spec.num_slices, engine, spec.prefix)
        with opening(engine.url), engine.begin() as conn:
            row = statements.find_queue(conn, name)
            created = False
            if row is None and items is not None:
                qid = statements.create_queue(conn, b, name, spec, items,
                                       spec.seed if spec.seed is not None else new_seed(),
                                       DEFAULT_MAX_ATTEMPTS if max_attempts is None else max_attempts,
                                       operator())
                created = qid is not None
                row = statements.find_queue(conn, name)
            if row is None:
                raise QueueNotFound(f"queue {name!r} was dropped while it was being created; try again")
            diffs = differences(conn, row, spec, max_attempts)
            if diffs:
                raise QueueConfigMismatch(name, diffs, extend_to(row, spec))
            return created, row
    finally:
        engine.dispose()


def extend_queue(name: str, num_epochs: int, url: Optional[str | URL] = None,
                 schema: Optional[str] = None) -> tuple[int, int]:
    """Raise a queue's ``num_epochs`` to ``num_epochs``, never lower it (``InvalidInput``);
    returns ``(before, after)``. Workers then join with the new ``num_epochs``; the new epochs are
    made as the workers reach them. Example: ``extend_queue("train", 5, url="sqlite:///q.db")``."""
    check_num_epochs(num_epochs)
    with _queue_tx(name, url, schema) as (conn, row):
        if num_epochs < row.num_epochs or not statements.extend_epochs(conn, row.id, num_epochs):
            raise InvalidInput(f"queue {name!r} has {row.num_epochs} epochs and num_epochs can only grow; "
                               f"give at least {row.num_epochs}")
    notify.ring(conn.engine, row.id)  # workers waiting at the old end see the new epochs now
    conn.engine.dispose()  # _queue_tx disposed it before; the ring may have connected again
    return row.num_epochs, num_epochs


def operator() -> str:
    """Who runs an operator verb, as ``wq_mixes.by`` records it: ``user@host (pid N)``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()} (pid {os.getpid()})"


def set_mix(name: str, weights: Mapping[str, float] | str, url: Optional[str | URL] = None,
            schema: Optional[str] = None, *, by: Optional[str] = None) -> mixing.MixOutcome:
    """Change the weights of a running weighted queue, for every worker at once, in one
    transaction: the items no worker has claimed yet are drawn again at the new weights (each
    worker follows from its next claim round), later epochs are drawn at them, and the change is
    recorded in ``wq_mixes`` with ``by`` (default: ``user@host (pid N)``) and the time.
    ``weights``: a dict, or text as ``wq-sql mix --set`` takes it (``"web=0.5,code=0.4,math=0.1"``).
    Bad weights raise ``InvalidInput`` and change nothing. Example:
    ``set_mix("train", {"web": 0.5, "code": 0.4, "math": 0.1}, url="sqlite:///q.db")``."""
    given = parse_weights(weights) if isinstance(weights, str) else weights
    with _queue_tx(name, url, schema) as (conn, row):
        out = mixing.set_mix(conn, row.id, given, by or operator(), row.shuffle, row.seed)
    return out


def _selected(conn: Any, qid: int, work: Optional[str], where: Optional[str]) -> list[int]:
    """The works a quarantine verb names: by ``work`` (a work or a shell-style pattern) or by
    ``where`` (a plain predicate, ``wq_sql.store.predicate``), exactly one of them."""
    if (work is None) == (where is None):
        raise InvalidInput("name the works either by work= (a work or a pattern such as 'data/bad-*') "
                           "or by where= (a predicate such as \"state = 'failed'\"), one of the two")
    if work is not None:
        if not isinstance(work, str) or not work:
            raise InvalidInput("work= must be a non-empty str: a work as given, or a pattern with * ? [...]")
        check_text("work", work)
        return quarantine_store.works_matching(conn, qid, work)
    if not isinstance(where, str):
        raise InvalidInput(f"where= must be a str, got {type(where).__name__}")
    check_text("where", where)
    return quarantine_store.works_where(conn, qid, where)


def quarantine(name: str, *, work: Optional[str] = None, where: Optional[str] = None, reason: str,
               url: Optional[str | URL] = None, schema: Optional[str] = None,
               by: Optional[str] = None) -> quarantine_store.QuarantineOutcome:
    """Put works of a running queue in quarantine, for every worker at once, in one transaction:
    no claim, requeue, reset, checkpoint restore or later epoch delivers their items until
    :func:`unquarantine`; an item in flight is taken back (dropped from its holder's buffer at
    its next claim round; if already handed out, its ack is rejected). ``work``: a work, or a
    shell-style pattern over the work strings (``"data/shard-00[3-5].tfrecord"``); ``where``: a
    plain SQL predicate over ``work``, ``source``, ``epoch``, ``seq``, ``state``, ``attempts``,
    ``worker``, ``last_error`` (``"state = 'failed' AND last_error LIKE '%CRC%'"``), parsed, never
    pasted. ``reason`` is recorded with ``by`` and the time. Raises ``InvalidInput``, with
    nothing changed, when nothing matches or the input is bad."""
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidInput("reason= must say why, e.g. reason='corrupt records (CRC errors)'")
    check_text("reason", reason)
    with _queue_tx(name, url, schema, ring=True) as (conn, row):  # it may end the queue
        idxs = _selected(conn, row.id, work, where)
        if not idxs:
            named = work if work is not None else where
            raise InvalidInput(f"no work of queue {row.name!r} matches {named!r}: nothing was quarantined "
                               "(SELECT DISTINCT work FROM wq_audit WHERE queue = '...' lists the works)")
        out = quarantine_store.quarantine(conn, row.id, idxs, reason.strip(), by or operator())
    return out


def unquarantine(name: str, *, work: Optional[str] = None, where: Optional[str] = None, all: bool = False,
                 url: Optional[str | URL] = None, schema: Optional[str] = None,
                 by: Optional[str] = None) -> tuple[int, int]:
    """Take works out of quarantine (named as for :func:`quarantine`, or ``all=True``): their
    quarantined items are pending again, attempts from 0. Returns (works, items). Raises
    ``InvalidInput`` when none of the works named is in quarantine (nothing changed)."""
    with _queue_tx(name, url, schema, ring=True) as (conn, row):  # items are claimable again
        inside = quarantine_store.quarantined_idxs(conn, row.id)
        if all:
            if work is not None or where is not None:
                raise InvalidInput("all=True takes no work= or where=")
            idxs = sorted(inside)
        else:
            idxs = [i for i in _selected(conn, row.id, work, where) if i in inside]
        if not idxs:
            raise InvalidInput(f"no work of queue {row.name!r} in quarantine matches "
                               f"{'all' if all else work if work is not None else where!r}: nothing changed")
        out = quarantine_store.unquarantine(conn, row.id, idxs, by or operator())
    return out


def quarantined(name: str, url: Optional[str | URL] = None,
                schema: Optional[str] = None) -> list[quarantine_store.Quarantined]:
    """The works of queue ``name`` in quarantine: work, reason, who, when, items held back."""
    with _queue_read(name, url, schema) as (conn, row):
        return quarantine_store.in_quarantine(conn, row.id)


@dataclass(frozen=True)
class MixReport:
    """A weighted queue's sources (weights in force), its changes (``wq_mixes`` rows, oldest
    first) and per epoch and source what it drew and delivered (``mixing.Share``)."""

    name: str
    sources: list[Source]
    changes: list[Any]
    shares: list[mixing.Share]


def mix_report(name: str, url: Optional[str | URL] = None, schema: Optional[str] = None) -> MixReport:
    """The weights in force, their history and the realized shares of queue ``name``
    (``QueueNotFound`` for a queue without sources)."""
    with _queue_read(name, url, schema) as (conn, row):
        sources = mixing.load_sources(conn, row.id)
        if not sources:
            raise QueueNotFound(f"queue {row.name!r} has no weighted sources (it was created from a list "
                                "of works)")
        return MixReport(row.name, sources, mixing.changes(conn, row.id), mixing.shares(conn, row.id))


def reset_queue(name: str, url: Optional[str | URL] = None, schema: Optional[str] = None) -> None:
    """Start a queue over at epoch 0 (same works and seed); its history is deleted.

    Stop its workers first: items they hold are forgotten."""
    with _queue_tx(name, url, schema) as (conn, row):
        statements.reset_queue(conn, row.id, row.n_works, row.shuffle, row.seed)


def drop_queue(name: str, url: Optional[str | URL] = None, schema: Optional[str] = None) -> bool:
    """Delete a queue and everything it holds; returns whether it existed."""
    with _queue_tx(name, url, schema, must_exist=False) as (conn, row):
        if row is None:
            return False
        statements.drop_queue(conn, row.id)
        return True


def list_queues(url: Optional[str | URL] = None, schema: Optional[str] = None) -> list[dict[str, Any]]:
    """Every queue with its configuration and progress (from the counters)."""
    engine = _engine(url, schema)
    try:
        with opening(engine.url):
            migrate.ensure_schema(engine, schema)
        with opening(engine.url), engine.connect() as conn:
            out = []
            for row in statements.all_queues(conn):
                done, failed, quarantined = statements.progress(conn, row.id)
                out.append({
                    "name": row.name, "items_per_epoch": row.n_works, "num_epochs": row.num_epochs,
                    "shuffle": row.shuffle, "seed": row.seed, "num_slices": row.num_slices,
                    "prefix": row.prefix, "epochs_created": row.epochs_created,
                    "done": done, "failed": failed, "quarantined": quarantined,
                    "total": row.n_works * row.num_epochs,
                })
            return out
    finally:
        engine.dispose()


def compact_queue(name: str, url: Optional[str | URL] = None, schema: Optional[str] = None, *,
                  keep_events: bool = False) -> int:
    """Shrink a long job: delete the ``done`` item rows of every finished epoch except the
    newest one (and their events, unless ``keep_events``). Failed items and their events are
    kept; ``wq_tallies`` keeps per-epoch, per-worker counts; progress and ``QueueExhausted`` read
    only the counters, so they are unaffected. Returns the number of item rows deleted."""
    with _queue_tx(name, url, schema) as (conn, row):
        epochs = [e for e in statements.finished_epochs(conn, row.id, row.n_works)
                  if e < row.epochs_created - 1]
        return statements.compact(conn, row.id, epochs, keep_events)


def trace(name: str, *, step: Optional[int] = None, steps: Optional[range] = None,
          checkpoint: Optional[int] = None, work: Optional[str] = None, worker: Optional[str] = None,
          run: Optional[int] = None, url: Optional[str | URL] = None,
          schema: Optional[str] = None) -> list[lineage_store.Traced]:
    """The lineage rows of queue ``name`` (trained with ``lineage=True``): which items, and which
    records of each (``first_record`` .. ``last_record``), the batches of training steps held,
    in (worker, run, step) order and each step's rows in its batch's order. One of:

    - ``step`` (or ``steps``, a ``range``): those steps of each rank (``worker``: of one), each in
      the rank's latest run that recorded it (``run``: in that run);
    - ``checkpoint``: every step that trained an item that the checkpoint at that global step
      covered (``consumed="checkpoint"``);
    - ``work``: every step that trained on the work (as stored, or as handed out with the
      queue's prefix).

    A step, worker, run, checkpoint or work with no lineage raises :class:`InvalidInput`
    saying what was recorded."""
    chosen = [k for k, v in (("step", step), ("steps", steps), ("checkpoint", checkpoint), ("work", work))
              if v is not None]
    if len(chosen) != 1:
        raise InvalidInput("trace needs exactly one of step=, steps=, checkpoint= or work= "
                           f"(got {', '.join(chosen) or 'none'})")
    if step is not None:
        steps = range(_whole("step", step), step + 1)
    if steps is not None and (not isinstance(steps, range) or steps.step != 1 or len(steps) == 0
                              or steps.start < 0):
        raise InvalidInput(f"steps must be a non-empty range(a, b) with 0 <= a < b, got {steps!r}")
    if run is not None:
        _whole("run", run)
    with _queue_read(name, url, schema) as (conn, row):
        recorded = lineage_store.recorded(conn, row.id)
        if not recorded:
            raise InvalidInput(f"queue {row.name!r} holds no lineage: train with lineage=True "
                               "(wq_sql.torch.QueueDataset, wq_sql.tf.WorkQueue) to record it")
        if worker is not None and worker not in {r.worker for r in recorded}:
            raise InvalidInput(f"worker {worker!r} recorded no lineage in queue {row.name!r}; "
                               f"workers with lineage: {_workers_of(recorded)}")
        mine = [r for r in recorded if worker is None or r.worker == worker]
        if run is not None and run not in {r.run for r in mine}:
            raise InvalidInput(f"run {run} recorded no lineage in queue {row.name!r}"
                               f"{'' if worker is None else f' for worker {worker!r}'}; recorded: "
                               f"{_described(mine)}")
        if steps is not None:
            found = lineage_store.traced(conn, row.id, worker=worker, run=run, steps_from=steps.start,
                                         steps_to=steps.stop)
            latest: dict[tuple[str, int], int] = {}
            for t in found:  # each step of each rank: its latest run
                latest[(t.worker, t.step)] = max(t.run, latest.get((t.worker, t.step), t.run))
            found = [t for t in found if t.run == latest[(t.worker, t.step)]]
            if not found:
                what = f"step {steps.start}" if len(steps) == 1 else f"steps {steps.start}..{steps.stop - 1}"
                raise InvalidInput(f"{what} of queue {row.name!r} recorded no lineage; recorded: "
                                   f"{_described([r for r in mine if run is None or r.run == run])}")
            return found
        if checkpoint is not None:
            found = lineage_store.traced(conn, row.id, worker=worker, run=run,
                                         checkpoint=_whole("checkpoint", checkpoint))
            if not found:
                saved = lineage_store.checkpoints_recorded(conn, row.id)
                some = _listed(saved) if saved else "none (consumed='checkpoint' records them)"
                raise InvalidInput(f"no item with lineage in queue {row.name!r} was covered by a checkpoint "
                                   f"at step {checkpoint}; checkpoints that covered some: {some}")
            return found
        assert work is not None
        check_text("work", work)
        idxs = lineage_store.work_indexes(conn, row.id, work, row.prefix)
        if not idxs:
            raise InvalidInput(f"queue {row.name!r} has no work {work!r} (give it as stored, as "
                               "wq-sql audit prints it, or as handed out with the queue's prefix)")
        found = lineage_store.traced(conn, row.id, worker=worker, run=run, work_idxs=idxs)
        if not found:
            whose = "" if worker is None else f"of worker {worker!r}, "
            raise InvalidInput(f"work {work!r} of queue {row.name!r} is in no recorded step "
                               f"({whose}recorded: {_described(mine)})")
        return found


def replay_steps(name: str, *, worker: str, steps: range, run: Optional[int] = None,
                 url: Optional[str | URL] = None,
                 schema: Optional[str] = None) -> list[list[lineage_store.Traced]]:
    """What the shims' replays read: for each step of ``steps`` of rank ``worker``, in order,
    its batch's lineage rows in batch order (each step from the rank's latest run that recorded
    it; ``run``: from that run). Every step of the range must have lineage, else
    :class:`InvalidInput` says which do not and what was recorded."""
    if not isinstance(worker, str):
        raise InvalidInput(f"worker must be the rank's identity (a str, as wq-sql trace prints it), "
                           f"got {worker!r}")
    by_step: dict[int, list[lineage_store.Traced]] = {}
    for t in trace(name, steps=steps, worker=worker, run=run, url=url, schema=schema):
        by_step.setdefault(t.step, []).append(t)
    missing = [s for s in steps if s not in by_step]
    if missing:
        raise InvalidInput(f"steps {_listed(missing)} of worker {worker!r} in queue {name!r} have no lineage "
                           f"({len(missing)} of the {len(steps)} asked for; recorded steps of the range: "
                           f"{min(by_step)}..{max(by_step)}): ask for a range the rank trained and "
                           "acknowledged (wq-sql trace shows it)")
    return [by_step[s] for s in steps]


def _whole(what: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InvalidInput(f"{what} must be an int >= 0, got {n!r}")
    return n


def _listed(values: Sequence[object], most: int = 10) -> str:
    shown = ", ".join(str(v) for v in values[:most])
    return shown + (f", ... ({len(values)} in all)" if len(values) > most else "")


def _workers_of(recorded: Sequence[lineage_store.Recorded]) -> str:
    return _listed(sorted({r.worker for r in recorded}))


def _described(recorded: Sequence[lineage_store.Recorded]) -> str:
    return _listed([f"worker {r.worker!r} run {r.run} steps {r.first_step}..{r.last_step}" for r in recorded],
                   most=6) or "nothing"
