"""The flat layout's import paths still work for one release, each with a DeprecationWarning
naming the new path, and are the new modules themselves (or, for a split one, their names)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from backends import ROOT

from wq_sql import _moved

CHECK = textwrap.dedent("""
    import importlib, sys, warnings
    import wq_sql
    old_name, new_names = sys.argv[1], sys.argv[2:]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module(old_name)
    print(" | ".join(str(w.message) for w in caught if w.category is DeprecationWarning))
    new = [importlib.import_module(n) for n in new_names]
    if len(new) == 1:
        print(old is new[0])
    else:
        print(all(any(getattr(m, k, None) is v for m in new) for k, v in vars(old).items()
                  if not k.startswith("__")) and all(k in vars(old) for m in new for k in vars(m)
                                                      if not k.startswith("__")))
    print(new[0].__spec__.name)
""")


@pytest.mark.parametrize("old", sorted(n for n in _moved.MOVED if "tf" not in n))
def test_an_old_path_imports_with_a_warning(old: str) -> None:
    new = _moved.MOVED[old]
    out = subprocess.run([sys.executable, "-c", CHECK, old, *new], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    warned, same, spec = out.stdout.splitlines()
    assert f"{old} moved to {' and '.join(new)}" in warned, warned
    assert same == "True"
    assert spec == new[0]  # the new module keeps its own name


def test_old_engine_path_has_the_documented_names() -> None:
    sys.modules.pop("wq_sql.engine", None)
    with pytest.warns(DeprecationWarning, match="wq_sql.store.engine"):
        from wq_sql.engine import make_engine, resolve_url, safe_url  # type: ignore[import-not-found]
    from wq_sql.store.engine import make_engine as new_make_engine
    from wq_sql.store.redact import safe_url as new_safe_url

    assert make_engine is new_make_engine and safe_url is new_safe_url
    assert str(resolve_url("sqlite:///x.db")) == "sqlite:///x.db"


def test_an_old_module_is_an_attribute_of_the_package() -> None:
    import wq_sql
    from wq_sql.store import statements

    with pytest.warns(DeprecationWarning, match="wq_sql.store.statements"):
        sys.modules.pop("wq_sql.ops", None)
        wq_sql.__dict__.pop("ops", None)  # set by an earlier import of the old path
        assert wq_sql.ops is statements  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        wq_sql.nothing  # type: ignore[attr-defined]  # noqa: B018
