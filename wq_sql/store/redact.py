"""Passwords kept out of what wq_sql prints: ``safe_url`` (a URL with its password hidden),
``mask_secrets`` (a driver's message, whose DSN or URL may carry one) and ``redact`` (a
source's text, as the sources' messages show it)."""

from __future__ import annotations

import re

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

# Where a driver's message may carry a password: a libpq DSN field (psycopg2 quotes a value with
# '...' and backslash escapes), and the userinfo of a URL (SQLAlchemy's own parser lets a password
# hold anything but "@").
_DSN_PASSWORD = re.compile(r"(\bpassword\s*=\s*)(?:'(?:[^'\\]|\\.)*'?|[^\s']+)", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][\w+.-]*://[^\s:/@]*:)[^\s@]*@")
def safe_url(url: URL) -> str:
    """The URL as it may appear in logs and errors: the password hidden, nothing else changed."""
    return url.render_as_string(hide_password=True)


def mask_secrets(text: str) -> str:
    """``text`` (say, a driver's error message) with the value of a ``password=`` DSN field and
    the password of a ``scheme://user:password@`` URL replaced by ``***``; nothing else changes,
    so URLs in it stay pasteable."""
    return _URL_PASSWORD.sub(r"\1***@", _DSN_PASSWORD.sub(r"\1***", text))


# scheme://user:password@ anywhere in a text; the password runs to the last "@" before white
# space, so a password holding "@" or "/" is hidden whole (more may be hidden, never less).
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/?#@\s]*):\S*@")


def redact(text: str) -> str:
    """``text`` with the password of a URL in it replaced by ``***`` and the rest kept, found by
    the URL's structure, never by looking for the password's text: a text that parses as a URL is
    rendered by SQLAlchemy with ``hide_password=True``; in any other text, each
    ``scheme://user:password@`` loses its password.

    >>> redact("table://reader:Secr3tPw@dwh/events")
    'table://reader:***@dwh/events'
    >>> redact("table:postgresql://reader:Secr3tPw@dwh/events")
    'table:postgresql://reader:***@dwh/events'
    >>> redact("lines:/data/what?.txt")
    'lines:/data/what?.txt'
    """
    try:
        url = make_url(text)
    except (ArgumentError, ValueError):
        url = None
    # Several "@": the password may hold one unquoted, where the URL parser would cut it short.
    if url is not None and url.password is not None and text.count("@") == 1:
        return url.render_as_string(hide_password=True)
    return _USERINFO.sub(r"\g<head>:***@", text)
