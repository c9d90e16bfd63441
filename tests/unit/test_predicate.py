"""The plain predicates of ``wq-sql quarantine --where``: what they compile to (values bound,
never pasted), and every way out of the language refused with a message that says where."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from wq_sql import InvalidInput
from wq_sql.store.predicate import parse

T = sa.table("t", sa.column("work"), sa.column("epoch"), sa.column("state"), sa.column("last_error"))
COLUMNS = {"work": T.c.work, "epoch": T.c.epoch, "state": T.c.state, "last_error": T.c.last_error}


def compiled(text: str) -> tuple[str, dict[str, object], set[str]]:
    expr, used = parse(text, COLUMNS)
    c = expr.compile(dialect=sa.dialects.sqlite.dialect())
    return str(c), dict(c.params), used


def test_the_language_compiles_with_every_value_bound() -> None:
    sql, params, used = compiled("state = 'failed' AND (last_error LIKE '%CRC%' OR epoch >= 2)")
    assert sql == "t.state = ? AND (t.last_error LIKE ? OR t.epoch >= ?)"
    assert sorted(map(str, params.values())) == ["%CRC%", "2", "failed"]
    assert used == {"state", "last_error", "epoch"}
    sql, params, _ = compiled("NOT work IN ('a', 'it''s') AND epoch BETWEEN 1 AND 3 "
                              "AND last_error IS NOT NULL")
    assert "NOT IN" in sql or "NOT (t.work IN" in sql
    assert ["a", "it's"] in params.values() and "BETWEEN" in sql and "IS NOT NULL" in sql
    sql, _, _ = compiled("work not like 'x%' and epoch <> 0")  # keywords in any case
    assert "NOT LIKE" in sql and "!=" in sql


@pytest.mark.parametrize("text, where", [
    ("work = 'a'; DROP TABLE wq_items", "';'"),
    ("work = 'a' -- comment", "'-'"),
    ("lower(work) = 'a'", "("),
    ("work IN (SELECT work FROM wq_works)", "SELECT"),
    ('"work" = 1', "'\"'"),
    ("nosuch = 1", "nosuch"),
    ("work = 'unterminated", "'"),
    ("work =", "end"),
    ("(work = 'a'", ")"),
    ("work = 'a' OR", "end"),
    ("work", "end"),
    ("   ", "empty"),
])
def test_anything_else_is_refused_saying_where(text: str, where: str) -> None:
    with pytest.raises(InvalidInput) as e:
        parse(text, COLUMNS)
    message = str(e.value)
    assert "--where" in message and where in message, message
