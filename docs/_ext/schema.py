"""``{wq-schema}``: the tables and views of the job table, rendered from ``wq_sql.store.models``
at build time, so the reference cannot drift from the models."""

from __future__ import annotations

from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective


def _table_lines(table: Any) -> list[str]:
    rows = [("column", "type", "null", "key")]
    for c in table.columns:
        rows.append((f"``{c.name}``", f"``{c.type}``".replace("\n", " "), "yes" if c.nullable else "no",
                     "primary" if c.primary_key else ""))
    return [".. list-table::", "   :header-rows: 1", ""] + [
        line for row in rows for line in
        ([f"   * - {row[0]}"] + [f"     - {cell}" for cell in row[1:]])] + [""]


class Schema(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        from wq_sql.store import models

        lines: list[str] = []
        for table in models.Base.metadata.sorted_tables:
            doc = (table.comment or "").strip()
            lines += [f".. rubric:: {table.name}", ""]
            if doc:
                lines += [doc, ""]
            lines += _table_lines(table)
        for name, sql in models.VIEWS.items():
            lines += [f".. rubric:: {name} (view)", "", ".. code-block:: sql", ""]
            lines += ["   " + ln for ln in sql.format(s="").strip().splitlines()] + [""]
        container = nodes.section()
        container.document = self.state.document
        self.state.nested_parse(StringList(lines), self.content_offset, container)
        return list(container.children)


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("wq-schema", Schema)
    return {"parallel_read_safe": True}
