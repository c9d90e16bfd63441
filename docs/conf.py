"""Sphinx configuration of wq_sql's docs site (``make docs``).

The source folder is the repository's root (``sphinx-build -c docs . docs/_build/html``), so
that the README, BENCHMARKS.md, CHANGELOG.md and CONTRIBUTING.md are pages of the site and every
link between them and the docs resolves the same on the site and on GitHub; only those files and
``docs/`` are read (``include_patterns``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # wq_sql from this checkout
sys.path.insert(0, str(HERE / "_ext"))
logging.getLogger("alembic").setLevel(logging.WARNING)  # its import-time INFO lines are noise here

project = "wq_sql"
author = "the wq_sql developers"
copyright = "the wq_sql developers, Apache-2.0"  # noqa: A001 - Sphinx's name

root_doc = "docs/index"
include_patterns = ["README.md", "BENCHMARKS.md", "CHANGELOG.md", "CONTRIBUTING.md", "docs/**"]
exclude_patterns = ["docs/_build", "docs/_ext"]

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.autosummary", "schema"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_heading_anchors = 3  # links to a page's sections (`design.md#the-map-...`)
myst_enable_extensions = ["colon_fence"]

# The shims' frameworks (and numpy, which the TF shim imports) are not needed to read their docstrings:
# make lint builds the site in a venv without TensorFlow.
autodoc_mock_imports = ["tensorflow", "numpy", "torch", "torchdata"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}

html_theme = "furo"
html_title = "wq_sql"
