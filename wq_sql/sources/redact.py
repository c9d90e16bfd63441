"""User input as the sources' messages show it: with any password hidden."""

from __future__ import annotations

import re

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

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
