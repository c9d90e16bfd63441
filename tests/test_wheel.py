"""The built wheel works on its own: the Alembic scripts ship inside ``wq_sql`` (as
``wq_sql._migrations``), never as a top-level ``migrations`` package, and an installed copy can
create and upgrade a database and run a queue, from a directory far from the checkout.

One wheel and one fresh venv per session (about half a minute; pip fetches the dependencies from
the package index or its cache).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from wq_sql.store.migrate import head_revision

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
# What a source checkout has that the build must not see (a stale build/ or egg-info would leak
# files into the wheel).
IGNORE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__",
                                ".pytest_cache", ".ruff_cache", ".mypy_cache", "*.db", "*.db-*")


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 240) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n"
                             f"{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def _clean_env(home: Path) -> dict[str, str]:
    """The environment of a user who installed the wheel: no PYTHONPATH, no wq_sql settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
           and not k.startswith("WQ_SQL_")}
    env["HOME"] = os.environ.get("HOME", str(home))
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the checkout (the build leaves nothing in the checkout)."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    shutil.rmtree(src / "tests", ignore_errors=True)
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(work / "dist"), str(src)], cwd=work)
    wheels = list((work / "dist").glob("wq_sql-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def venv_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only the wheel (and its dependencies) installed."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=venv.parent)
    py = venv / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "--quiet", str(wheel)], cwd=venv.parent,
         env=_clean_env(venv.parent))
    return py


def test_wheel_ships_the_migrations_inside_the_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "wq_sql/_migrations/env.py" in names
    assert "wq_sql/_migrations/script.py.mako" in names
    assert "wq_sql/monitor/dashboard.html" in names  # the page `wq-sql dashboard` serves
    # Every module of the checkout's package folders (a folder missing from pyproject's list
    # would install without its modules).
    missing = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "wq_sql").rglob("*.py")
                     if str(f.relative_to(ROOT)) not in names)
    assert not missing, missing
    versions = [n for n in names if n.startswith("wq_sql/_migrations/versions/")
                and n.endswith(".py") and not n.endswith("__init__.py")]
    assert versions, names
    # Every revision in the checkout is in the wheel.
    in_checkout = sorted(p.name for p in (ROOT / "migrations" / "versions").glob("*.py")
                         if p.name != "__init__.py")
    assert sorted(Path(v).name for v in versions) == in_checkout
    # No top-level package but wq_sql: no "migrations", no "tests".
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"wq_sql"}, tops
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["wq_sql"]
    # TensorFlow only behind the extra.
    metadata = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any("sqlalchemy" in r.lower() for r in requires)
    assert all("extra ==" in r for r in requires if "tensorflow" in r.lower())
    assert all("extra ==" in r for r in requires if "prometheus" in r.lower())


def test_installed_wheel_runs_a_queue_outside_the_checkout(
        venv_python: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = _clean_env(tmp_path)
    script = textwrap.dedent("""
        import os, sys
        import wq_sql
        from wq_sql import WorkQueue
        from wq_sql.store.migrate import migrations_dir
        assert "tensorflow" not in sys.modules
        print("FILE", wq_sql.__file__)
        print("MIGRATIONS", migrations_dir())
        with WorkQueue(["a", "b", "c"], num_epochs=2, shuffle=False, url="sqlite:///queue.db",
                       worker="w") as wq:
            got = list(wq)
        print("GOT", ",".join(got))
        rows = wq_sql.list_queues("sqlite:///queue.db")
        print("DONE", rows[0]["done"], rows[0]["total"])
        import sqlite3
        rev = sqlite3.connect("queue.db").execute("SELECT version_num FROM alembic_version")
        print("REV", rev.fetchone()[0])
        try:
            import migrations
        except ImportError:
            print("NO_TOP_LEVEL_MIGRATIONS")
    """)
    out = _run([str(venv_python), "-c", script], cwd=workdir, env=env, timeout=120).stdout
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    site = venv_python.parent.parent
    assert Path(lines["FILE"]).is_relative_to(site), lines["FILE"]
    assert not Path(lines["FILE"]).is_relative_to(ROOT)
    assert Path(lines["MIGRATIONS"]).is_relative_to(site)
    assert lines["MIGRATIONS"].endswith("wq_sql/_migrations")
    assert lines["GOT"] == "a,b,c,a,b,c"
    assert lines["DONE"] == "6 6"
    assert lines["REV"] == head_revision()
    assert "NO_TOP_LEVEL_MIGRATIONS" in out
    assert (workdir / "queue.db").exists()
    site_packages = list(site.glob("lib/python*/site-packages"))
    assert site_packages and not (site_packages[0] / "migrations").exists()


def test_installed_wheel_upgrades_from_the_command_line(venv_python: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "ops"
    workdir.mkdir()
    env = _clean_env(tmp_path)
    db = workdir / "fresh.db"
    url = f"sqlite:///{db}"
    if (ROOT / "wq_sql" / "__main__.py").exists():
        p = _run([str(venv_python), "-m", "wq_sql", "upgrade", "--url", url], cwd=workdir, env=env,
                 timeout=120)
        assert head_revision() in p.stdout + p.stderr
        # The console script is installed too, and agrees.
        wq_sql_cmd = venv_python.parent / "wq-sql"
        if wq_sql_cmd.exists():
            p = _run([str(wq_sql_cmd), "current", "--url", url], cwd=workdir, env=env, timeout=120)
            assert head_revision() in p.stdout
    else:  # the command line is not there yet: the programmatic entry point
        _run([str(venv_python), "-c", f"import wq_sql; print(wq_sql.upgrade({url!r}))"], cwd=workdir,
             env=env, timeout=120)
    rev = _run([str(venv_python), "-c",
                f"import sqlite3; print(sqlite3.connect({str(db)!r}).execute("
                "'SELECT version_num FROM alembic_version').fetchone()[0])"],
               cwd=workdir, env=env).stdout.strip()
    assert rev == head_revision()
    # The upgraded database is usable by the installed package.
    out = _run([str(venv_python), "-c",
                f"from wq_sql import WorkQueue\n"
                f"with WorkQueue(['x'], url={url!r}, worker='w') as wq: print(list(wq))"],
               cwd=workdir, env=env).stdout
    assert "['x']" in out
