"""Vigil's one Redis URL, as text: which shapes it may take and how it is shown.

    redis://[[user]:password@]host:6379/0       plain TCP; AUTH with requirepass or an ACL user
    rediss://[[user]:password@]host:6380/0      TLS
    sentinel://[[user]:password@]s1:26379/0;sentinel://s2:26379/0   Redis Sentinel
    unix://[[user]:password@]/path/redis.sock?db=0

Pure string handling, no connection: the settings check a URL with `check_url` before anything
connects, and `redacted_url` is the only form of the URL that logs, errors and `vigil status`
show (credentials never leave in text). Connections are built in app/state/conn.py.
"""
from __future__ import annotations

from urllib.parse import unquote, urlsplit

SCHEMES = ("redis://", "rediss://", "unix://", "sentinel://")
SENTINEL_SEPARATOR = ";"


def redacted_url(url: str) -> str:
    """The URL without user, password or query: `scheme://host:port/db` (each entry of a
    sentinel URL alike, joined by `;`; `unix:///path` for a socket)."""
    out = []
    for chunk in url.split(SENTINEL_SEPARATOR):
        try:
            u = urlsplit(chunk.strip())
            host = u.hostname or ""
        except ValueError:  # e.g. an unclosed '[': show nothing of it rather than raise here
            out.append("(unparseable)")
            continue
        try:
            port = u.port
        except ValueError:  # a malformed port is shown as nothing
            port = None
        out.append(f"{u.scheme}://{host}{':' + str(port) if port else ''}{u.path}")
    return SENTINEL_SEPARATOR.join(out)


def is_sentinel(url: str) -> bool:
    """True for a `sentinel://` URL (one or more `;`-separated sentinels)."""
    return url.startswith("sentinel://")


def is_tls(url: str) -> bool:
    """True for a `rediss://` URL."""
    return url.startswith("rediss://")


def check_url(url: str) -> str:
    """The URL if Vigil can use it; ValueError otherwise, whose message never quotes the URL
    (it may hold a password)."""
    if not url.startswith(SCHEMES):
        raise ValueError("must start with redis://, rediss://, unix:// or sentinel://")
    if is_sentinel(url):
        for chunk in url.split(SENTINEL_SEPARATOR):
            u = urlsplit(chunk.strip())
            if u.scheme != "sentinel" or not u.hostname:
                raise ValueError("a sentinel URL is sentinel://host:port entries joined by ';'")
            _port(u)
    elif not url.startswith("unix://"):
        u = urlsplit(url)
        if not u.hostname:
            raise ValueError("names no host")
        _port(u)
    return url


def _port(u) -> int | None:
    try:
        return u.port
    except ValueError:
        raise ValueError("has a port that is not a number from 0 to 65535") from None


def sentinel_addresses(url: str) -> list[tuple[str, int]]:
    """(host, port) of every sentinel in a `sentinel://` URL (26379 when none is given)."""
    out = []
    for chunk in url.split(SENTINEL_SEPARATOR):
        u = urlsplit(chunk.strip())
        out.append((u.hostname or "localhost", u.port or 26379))
    return out


def credentials_and_db(url: str) -> tuple[str | None, str | None, int]:
    """User, password (percent-decoded) and database of a sentinel URL's first entry."""
    u = urlsplit(url.split(SENTINEL_SEPARATOR)[0].strip())
    db = u.path.strip("/")
    return (unquote(u.username) if u.username else None,
            unquote(u.password) if u.password else None,
            int(db) if db.isdigit() else 0)
