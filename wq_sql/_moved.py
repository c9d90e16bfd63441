"""The import paths of the flat layout, kept for one release: ``import wq_sql.engine`` (and every
other module that moved into ``store/``, ``worker/``, ``monitor/`` or ``tf/``) still works, with a
``DeprecationWarning`` that names the new path. A path whose module was split in two gives a
module holding the names of both.

The old name is an alias, not a copy: ``wq_sql.engine`` *is* ``wq_sql.store.engine``, so a
setting changed through either is seen by both. (Of a split module, the alias holds the names;
patch the new module to change what the library calls.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Optional

# Old path -> the module(s) that hold its names now (the first one is the main one).
MOVED: dict[str, tuple[str, ...]] = {
    "wq_sql.bell": ("wq_sql.store.notify",),
    "wq_sql.claim": ("wq_sql.store.hot.claim",),
    "wq_sql.dashboard": ("wq_sql.monitor.dashboard",),
    "wq_sql.db": ("wq_sql.store.db",),
    "wq_sql.dialects": ("wq_sql.store.dialects",),
    "wq_sql.dialects.postgresql": ("wq_sql.store.dialects.postgresql",),
    "wq_sql.dialects.sqlite": ("wq_sql.store.dialects.sqlite",),
    "wq_sql.endings": ("wq_sql.worker.outcomes",),
    "wq_sql.engine": ("wq_sql.store.engine", "wq_sql.store.driver", "wq_sql.store.redact"),
    "wq_sql.epochs": ("wq_sql.worker.epochs",),
    "wq_sql.handout": ("wq_sql.worker.dispenser",),
    "wq_sql.holdings": ("wq_sql.worker.book",),
    "wq_sql.identity": ("wq_sql.worker.identity",),
    "wq_sql.join": ("wq_sql.worker.joining",),
    "wq_sql.lease": ("wq_sql.worker.heartbeat",),
    "wq_sql.leaving": ("wq_sql.store.hot.leave",),
    "wq_sql.ledger": ("wq_sql.worker.checkpoints",),
    "wq_sql.liveness": ("wq_sql.worker.heartbeat",),
    "wq_sql.look": ("wq_sql.store.hot.poll",),
    "wq_sql.metrics": ("wq_sql.monitor.metrics",),
    "wq_sql.migrate": ("wq_sql.store.migrate",),
    "wq_sql.mismatch": ("wq_sql.worker.joining",),
    "wq_sql.models": ("wq_sql.store.models",),
    "wq_sql.ops": ("wq_sql.store.statements",),
    "wq_sql.pacer": ("wq_sql.worker.refill", "wq_sql.worker.sizing"),
    "wq_sql.pooling": ("wq_sql.store.dialects.postgresql", "wq_sql.store.driver"),
    "wq_sql.registry": ("wq_sql.worker.process",),
    "wq_sql.renewal": ("wq_sql.store.hot.renew",),
    "wq_sql.report": ("wq_sql.monitor.report",),
    "wq_sql.sources.redact": ("wq_sql.store.redact",),
    "wq_sql.tf_checkpoint": ("wq_sql.tf.checkpoint",),
    "wq_sql.tf_readers": ("wq_sql.tf.readers",),
    "wq_sql.torch.handoff": ("wq_sql.torch.claiming", "wq_sql.torch.acks"),
    "wq_sql.watch": ("wq_sql.monitor.snapshot",),
    "wq_sql.weak": ("wq_sql.worker.process",),
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths (before the path finder, which would load a moved package's
    submodule a second time under its old name)."""

    def __init__(self) -> None:
        self._specs: dict[int, Optional[importlib.machinery.ModuleSpec]] = {}

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[types.ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {' and '.join(new)}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        modules = [importlib.import_module(n) for n in new]
        if len(modules) == 1:
            # The import system sets the new module's __spec__ to this alias's: exec_module
            # puts the module's own back.
            self._specs[id(modules[0])] = modules[0].__spec__
            return modules[0]
        merged = types.ModuleType(spec.name, modules[0].__doc__)
        for m in reversed(modules):
            merged.__dict__.update({k: v for k, v in vars(m).items() if not k.startswith("__")})
        return merged

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is the new one (or its names)."""
        own = self._specs.pop(id(module), None)
        if own is not None:
            module.__spec__ = own


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
