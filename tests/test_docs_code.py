"""Every Python block of the README and of the user guide runs as written, on every backend.

Each block runs in a fresh process with a harness: a prelude that makes the names the block
leaves to the reader (``train_on``, ``files``, ``model``, ...) and a postlude that checks what
the block promises (every item trained, each record once). The database URLs in a block
(``"sqlite:///jobs.db"``, ``"postgresql://user@db/jobs"``, ``url=...``) become this test's
database; ``$WQ_SQL_URL`` names it too. A block without a harness fails the test: a new example
in the docs gets one.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from backends import ROOT, run_py

PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guide").glob("*.md"))]

FILES = """
import os
from pathlib import Path
os.makedirs("data", exist_ok=True)
files, all_lines = [], []
for i in range(6):
    lines = [f"file {i} line {j}" for j in range(5)]
    Path(f"data/part-{i}.txt").write_text("\\n".join(lines) + "\\n")
    files.append(f"data/part-{i}.txt")
    all_lines += lines
filename, filename1, filename2, filename3 = files[:4]
"""


LINES = "def read_lines(path):\n    with open(path) as f:\n        return f.read().splitlines()\n"


@dataclass(frozen=True)
class Harness:
    prelude: str = ""
    postlude: str = ""
    needs: str = ""  # "postgresql": that backend only


QUICK_START = Harness("trained = []\ndef train_on(path):\n    trained.append(path)\n",
                      'assert sorted(trained) == sorted(["part-0.txt", "part-1.txt", "part-2.txt"] * 2), '
                      "trained\n")
HARNESSES = {
    "from wq_sql import WorkQueue\n\nweb_files": Harness(  # the mixing guide's
        "trained = []\ndef train_on(path):\n    trained.append(path)\n",
        "from collections import Counter\n"
        "c = Counter(p.split('/')[0] for p in trained)\n"
        "assert c == {'web': 1200, 'code': 600, 'math': 200}, c\n"
        "assert len(set(p for p in trained if p.startswith('math'))) == 200\n"),
    "from wq_sql import WorkQueue\n\n# Every worker": QUICK_START,  # the README's
    "from wq_sql import WorkQueue, QueueExhausted": QUICK_START,  # the guide's
    "import logging": Harness(
        "", 'assert logging.getLogger("wq_sql").level == logging.INFO and logging.getLogger().handlers\n'),
    "# from tensorflow.python.ops.work_queue import WorkQueue": Harness(
        "import tensorflow as tf\n" + FILES,
        "got = sorted(x.numpy().decode() for x in dataset)\n"
        "assert got == sorted(all_lines[:20]), got\n"
        "work_queue.close()\n"),
    'wq = WorkQueue(files, url=..., worker="trainer-0", consumed="checkpoint")': Harness(
        "import tensorflow as tf\nfrom wq_sql.tf import WorkQueue\n" + FILES
        + "model = tf.Module()\nmodel.w = tf.Variable(1.0)\noptimizer = tf.Variable(0)\nstep = 1\n",
        "n = sum(int(b.shape[0]) for b in iterator)\n"
        "assert n == len(all_lines), n\n"
        "assert manager.latest_checkpoint, 'no checkpoint saved'\n"
        "wq.close()\n"),
    "from wq_sql.torch import DataLoader, QueueDataset, ReplayDataset": Harness(  # the lineage guide's
        FILES + LINES + "url = URL\nbatches = []\ndef train_step(batch):\n    batches.append(list(batch))\n",
        "import wq_sql\n"
        "rows = wq_sql.trace('work_queue', steps=range(0, len(batches)), url=URL)\n"
        "content = {f: read_lines(f) for f in files}\n"
        "got = {}\n"
        "for t in rows:\n"
        "    got.setdefault(t.step, []).extend(content[t.work][t.first_record:t.last_record + 1])\n"
        "assert [got[k] for k in range(len(batches))] == batches, (got, batches)\n"),
    "import tensorflow as tf\nfrom wq_sql.tf import WorkQueue, replay_dataset": Harness(  # lineage, TF
        FILES + "import tensorflow as tf\nurl = URL\n"
        "def parse(line):\n"
        "    n = tf.strings.to_number(tf.strings.split(line)[-1], tf.float32)\n"
        "    return tf.reshape(n, [1]), tf.reshape(n, [1])\n"
        "model = tf.keras.Sequential([tf.keras.Input(shape=(1,)), tf.keras.layers.Dense(1)])\n"
        "model.compile(optimizer='sgd', loss='mse')\n",
        "import wq_sql\n"
        "rows = wq_sql.trace('work_queue', steps=range(0, 23), url=URL)\n"
        "content = {f: open(f).read().splitlines() for f in files}\n"
        "def lines(step_rows):\n"
        "    return [x for t in step_rows for x in content[t.work][t.first_record:t.last_record + 1]]\n"
        "assert sorted(lines(rows)) == sorted(all_lines * 3)\n"
        "got = [float(v) for _, y in replay for v in y.numpy().ravel()]\n"
        "want = [float(x.split()[-1]) for x in lines([t for t in rows if t.step in (1, 2)])]\n"
        "assert got == want, (got, want)\n"),
    "from wq_sql.torch import ReplayDataset": Harness(  # the lineage guide's replay, after a run
        "import os\nos.environ['WQ_SQL_WORKER'], os.environ['RANK'] = 'job-7', '1'\n" + FILES + LINES
        + "from wq_sql.torch import DataLoader, QueueDataset\nurl = URL\ntrained, replayed = [], []\n"
        "ds = QueueDataset(files, num_epochs=3, url=URL, read=read_lines, lineage=True)\n"
        "loader = DataLoader(ds, batch_size=2, num_workers=2)\n"
        "for epoch in range(3):\n    trained += [list(b) for b in loader]\n"
        "def model(batch):\n    replayed.append(list(batch))\n    return 0.0\n",
        "assert replayed == trained[1:3], (replayed, trained[1:3])\n"),
    "from wq_sql.torch import DataLoader, QueueDataset": Harness(
        FILES + "batches = []\ndef train_step(batch):\n    batches.append(batch)\n",
        "got = sorted(r for b in batches for r in b)\n"
        "assert got == sorted(all_lines * 3), (len(got), len(all_lines) * 3)\n"),
    "ds = QueueDataset(files, num_epochs=3, url=..., read=read_records, consumed=\"checkpoint\")": Harness(
        "import os\nimport torch\nfrom wq_sql.torch import DataLoader, QueueDataset\n" + FILES
        + "def read_records(path):\n    with open(path) as f:\n        return f.read().splitlines()\n"
        + "model = torch.nn.Linear(1, 1)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        + "path = 'ckpt.pt'\nstep = 0\nbatches = []\ndef train_step(batch):\n    batches.append(batch)\n",
        "got = sorted(r for b in batches for r in b)\n"
        "assert got == sorted(all_lines * 3), (len(got), len(all_lines) * 3)\n"
        "assert os.path.exists(path)\n"),
    "import wq_sql\nfrom wq_sql import WorkQueue\n\n# SQL tables": Harness(
        "import sqlalchemy as sa\n"
        "eng = sa.create_engine(URL)\n"
        "with eng.begin() as c:\n"
        "    c.execute(sa.text('CREATE TABLE events (id integer PRIMARY KEY, payload text)'))\n"
        "    c.execute(sa.text(\"INSERT INTO events SELECT g, 'e' || g FROM generate_series(1, 50) g\"))\n"
        "    c.execute(sa.text('CREATE SCHEMA sales'))\n"
        "    c.execute(sa.text('CREATE TABLE sales.orders (day integer, id integer, payload text, '\n"
        "                      'PRIMARY KEY (day, id))'))\n"
        "    c.execute(sa.text(\"INSERT INTO sales.orders \"\n"
        "                      \"SELECT g % 7, g, 'o' FROM generate_series(1, 70) g\"))\n"
        "eng.dispose()\n"
        "from pathlib import Path\n"
        "Path('corpus.txt').write_text(''.join(f'line {i}\\n' for i in range(300)))\n"
        "rows, lines = [], []\n"
        "def train_on(x):\n"
        "    (lines if isinstance(x, bytes) else rows).append(x)\n",
        "assert len(rows) == 120, len(rows)\n"
        "assert sorted(lines) == sorted(f'line {i}'.encode() for i in range(300)), len(lines)\n",
        needs="postgresql"),
}
# What a block names that this test provides: a path the reader would have, steps its run has.
PATHS = {"/data/corpus-10GB.txt": "corpus.txt", "range(41_220, 41_240)": "range(1, 3)",
         "TextLineDataset, 256, map_fn": "TextLineDataset, 4, map_fn"}


def blocks() -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
            out.append((page, i, block))
    return out


def harness_of(block: str) -> Harness:
    for key, h in HARNESSES.items():
        if block.startswith(key):
            return h
    raise AssertionError(f"a Python block of the docs has no harness in {__file__}: add one for\n"
                         f"{textwrap.indent(block, '    ')}")


def runnable(block: str) -> str:
    code = re.sub(r'"(?:sqlite|postgresql)://[^"]*"', "URL", block)
    code = code.replace("url=...", "url=URL")
    for path, ours in PATHS.items():
        code = code.replace(path, ours)
    return code


@pytest.mark.parametrize("page, index, block", [pytest.param(*b, id=f"{b[0]}#{b[1]}") for b in blocks()])
def test_a_docs_block_runs_as_written(page: str, index: int, block: str, db_url: str, backend: str,
                                      tmp_path: Path) -> None:
    h = harness_of(block)
    if h.needs and h.needs != backend:
        pytest.skip(f"this block reads a {h.needs} database")
    code = ("import sys\nURL = sys.argv[1]\n" + h.prelude + "\n# ---- the block, as the docs print it\n"
            + runnable(block) + "\n# ---- what it promises\n" + h.postlude)
    run_py(code, db_url, timeout=300, env={"WQ_SQL_URL": db_url, "TF_CPP_MIN_LOG_LEVEL": "2"}, cwd=tmp_path)


def test_every_block_has_a_harness() -> None:
    for _, _, block in blocks():
        harness_of(block)
