"""A plain SQL predicate typed by an operator (``wq-sql quarantine --where``), parsed into a
SQLAlchemy expression over named columns, its values bound as parameters: the text is never
pasted into a statement.

The language is a WHERE clause without functions or subqueries::

    predicate  := disjunct (OR disjunct)*
    disjunct   := conjunct (AND conjunct)*
    conjunct   := NOT conjunct | '(' predicate ')' | test
    test       := column (= | != | <> | < | <= | > | >=) value
                | column [NOT] LIKE 'text'
                | column [NOT] IN (value, ...)
                | column [NOT] BETWEEN value AND value
                | column IS [NOT] NULL
    value      := 'text' (a quote doubled inside) | integer | decimal

Anything else (a function call, a second statement, a comment, a double-quoted name, a column
not offered) is refused with an error that says where and what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from sqlalchemy import and_, not_, or_

from wq_sql.errors import InvalidInput

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>'(?:[^']|'')*')
  | (?P<number>-?\d+(?:\.\d+)?)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op><=|>=|<>|!=|=|<|>)
  | (?P<punct>[(),])
""", re.VERBOSE)

KEYWORDS = {"AND", "OR", "NOT", "LIKE", "IN", "IS", "NULL", "BETWEEN"}


@dataclass(frozen=True)
class Token:
    kind: str  # string, number, name, keyword, op, punct, end
    text: str
    at: int


Value = Union[str, int, float]


def tokens(text: str) -> list[Token]:
    out, at = [], 0
    while at < len(text):
        m = _TOKEN.match(text, at)
        if m is None:
            raise _refused(text, at, f"unexpected {text[at]!r}")
        kind = m.lastgroup or ""
        if kind != "space":
            word = m.group()
            if kind == "name" and word.upper() in KEYWORDS:
                kind, word = "keyword", word.upper()
            out.append(Token(kind, word, at))
        at = m.end()
    out.append(Token("end", "", len(text)))
    return out


def parse(text: str, columns: Mapping[str, Any]) -> tuple[Any, set[str]]:
    """The predicate ``text`` as a SQLAlchemy expression over ``columns`` (name -> column
    expression), and the names it uses. Raises ``InvalidInput`` for anything else."""
    if not text.strip():
        raise InvalidInput("the predicate (--where, where=) is empty: give one such as "
                           "\"work LIKE '%/bad-%'\"")
    p = _Parser(text, tokens(text), columns)
    expr = p.predicate()
    if p.peek().kind != "end":
        raise _refused(text, p.peek().at, f"unexpected {p.peek().text!r}", columns)
    return expr, p.used


class _Parser:
    def __init__(self, text: str, toks: list[Token], columns: Mapping[str, Any]) -> None:
        self.text, self.toks, self.columns, self.k = text, toks, columns, 0
        self.used: set[str] = set()

    def peek(self) -> Token:
        return self.toks[self.k]

    def take(self) -> Token:
        t = self.toks[self.k]
        self.k += 1
        return t

    def keyword(self, word: str) -> bool:
        t = self.peek()
        if t.kind == "keyword" and t.text == word:
            self.k += 1
            return True
        return False

    def expect(self, kind: str, text: str, what: str) -> Token:
        t = self.peek()
        if t.kind != kind or t.text != text:
            raise self.error(t, f"expected {what}")
        return self.take()

    def error(self, t: Token, why: str) -> InvalidInput:
        found = "the end" if t.kind == "end" else repr(t.text)
        return _refused(self.text, t.at, f"{why}, found {found}", self.columns)

    def predicate(self) -> Any:
        parts = [self.disjunct()]
        while self.keyword("OR"):
            parts.append(self.disjunct())
        return parts[0] if len(parts) == 1 else or_(*parts)

    def disjunct(self) -> Any:
        parts = [self.conjunct()]
        while self.keyword("AND"):
            parts.append(self.conjunct())
        return parts[0] if len(parts) == 1 else and_(*parts)

    def conjunct(self) -> Any:
        if self.keyword("NOT"):
            return not_(self.conjunct())
        t = self.peek()
        if t.kind == "punct" and t.text == "(":
            self.take()
            inner = self.predicate()
            self.expect("punct", ")", "')'")
            return inner
        return self.test()

    def test(self) -> Any:
        t = self.take()
        if t.kind != "name":
            raise self.error(t, "expected a column name")
        name = t.text.lower()
        if name not in self.columns:
            raise self.error(t, f"no column {t.text!r}")
        self.used.add(name)
        col = self.columns[name]
        if self.keyword("IS"):
            negate = self.keyword("NOT")
            if not self.keyword("NULL"):
                raise self.error(self.peek(), "expected NULL after IS")
            return col.is_not(None) if negate else col.is_(None)
        negate = self.keyword("NOT")
        if self.keyword("LIKE"):
            pattern = self.value()
            if not isinstance(pattern, str):
                raise self.error(self.toks[self.k - 1], "LIKE takes a quoted text")
            return col.not_like(pattern) if negate else col.like(pattern)
        if self.keyword("IN"):
            self.expect("punct", "(", "'(' after IN")
            values = [self.value()]
            while self.peek().kind == "punct" and self.peek().text == ",":
                self.take()
                values.append(self.value())
            self.expect("punct", ")", "')' or ','")
            return col.not_in(values) if negate else col.in_(values)
        if self.keyword("BETWEEN"):
            low = self.value()
            if not self.keyword("AND"):
                raise self.error(self.peek(), "expected AND in BETWEEN")
            high = self.value()
            between = col.between(low, high)
            return not_(between) if negate else between
        if negate:
            raise self.error(self.peek(), "expected LIKE, IN or BETWEEN after NOT")
        op = self.take()
        if op.kind != "op":
            raise self.error(op, "expected a comparison (=, !=, <, <=, >, >=), LIKE, IN, BETWEEN or IS")
        v = self.value()
        return {"=": col == v, "!=": col != v, "<>": col != v, "<": col < v, "<=": col <= v,
                ">": col > v, ">=": col >= v}[op.text]

    def value(self) -> Value:
        t = self.take()
        if t.kind == "string":
            return t.text[1:-1].replace("''", "'")
        if t.kind == "number":
            return float(t.text) if "." in t.text else int(t.text)
        raise self.error(t, "expected a value: 'quoted text' or a number")


def _refused(text: str, at: int, why: str, columns: Mapping[str, Any] = {}) -> InvalidInput:
    offered = f" Columns: {', '.join(sorted(columns))}." if columns else ""
    return InvalidInput(
        f"the predicate (--where, where=) is not a plain one ({why} at character {at + 1} of {text!r}). Use "
        "comparisons (=, !=, <, <=, >, >=), LIKE, IN (...), BETWEEN, IS [NOT] NULL, joined by "
        f"AND, OR, NOT and parentheses, over quoted texts and numbers.{offered}")
