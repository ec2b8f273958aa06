"""How every Vigil process reaches Redis: one URL for the broker, the result backend and Vigil's
state, in the shapes Celery supports (docs/operations.md, "Redis beyond one box").

    redis://[[user]:password@]host:6379/0       plain TCP; AUTH with requirepass or an ACL user
    rediss://[[user]:password@]host:6380/0      TLS: VIGIL_REDIS_TLS_CA_FILE, _CERT_FILE, _KEY_FILE
    sentinel://[[user]:password@]s1:26379/0;sentinel://s2:26379/0
                                                Redis Sentinel: VIGIL_REDIS_SENTINEL_MASTER names
                                                the master; VIGIL_REDIS_SENTINEL_PASSWORD is the
                                                sentinels' own password, if they have one
    unix://[[user]:password@]/path/redis.sock?db=0

The three clients get the same endpoint and credentials from here: kombu (the broker) through
`broker_use_ssl` and its transport options, Celery's result backend through
`redis_backend_use_ssl` and its transport options, and Vigil's state client (`state_pool`).
A sentinel URL's credentials and database are read from its first entry, as kombu and Celery
read them. Reserved characters in a user or password are percent-encoded (`@` as `%40`).

The URL's text (its shapes, `redacted_url`) is app/redis_url.py's; this module builds the
connections.
"""
from __future__ import annotations

import ssl
import time

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from app.redis_url import credentials_and_db, is_sentinel, is_tls, redacted_url, sentinel_addresses
from app.settings import SettingsError, VigilSettings

# Connections beyond one per task thread: heartbeat, signal handlers, producers in the process.
REDIS_POOL_HEADROOM = 16


def tls_options(settings: VigilSettings) -> dict | None:
    """The TLS options of kombu's `broker_use_ssl` and Celery's `redis_backend_use_ssl` (the
    same keys redis-py's SSL connections take), or None for a plain connection.

    The server's certificate is always verified (CERT_REQUIRED), against
    VIGIL_REDIS_TLS_CA_FILE or else the system's trust store; the client presents
    VIGIL_REDIS_TLS_CERT_FILE (with its key) when the server asks for client certificates.
    """
    if not is_tls(settings.redis_url):
        return None
    opts: dict = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    for key, path in (("ssl_ca_certs", settings.redis_tls_ca_file),
                      ("ssl_certfile", settings.redis_tls_cert_file),
                      ("ssl_keyfile", settings.redis_tls_key_file)):
        if path is not None:
            opts[key] = str(path)
    return opts


def sentinel_kwargs(settings: VigilSettings) -> dict:
    """Connection options for the sentinels themselves: bounded timeouts, no retries, and their
    password.

    No retries: every master lookup asks the sentinels in turn, and redis-py's default retry
    (three, with up to seconds of backoff) made each dead sentinel cost seconds per lookup;
    without it, the next sentinel is asked at once (as Flower does).
    """
    kw: dict = {"socket_timeout": settings.redis_timeout,
                "socket_connect_timeout": settings.redis_timeout,
                "retry": Retry(NoBackoff(), 0)}
    password = settings.redis_sentinel_password.get_secret_value()
    if password:
        kw["password"] = password
    return kw


def transport_options(settings: VigilSettings) -> dict:
    """What kombu's and Celery's transport options need besides Vigil's own: the master's name
    and the sentinels' options for a sentinel URL, nothing otherwise."""
    if not is_sentinel(settings.redis_url):
        return {}
    return {"master_name": settings.redis_sentinel_master,
            "sentinel_kwargs": sentinel_kwargs(settings)}


class BlockingSentinelConnectionPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """A Sentinel-managed pool that blocks for a free connection (up to `timeout`) like
    redis.BlockingConnectionPool instead of raising "Too many connections"; connections to a
    master that was failed over are dropped on release, as in SentinelConnectionPool."""


def state_pool(settings: VigilSettings, *, max_connections: int,
               **connection_kwargs) -> redis.ConnectionPool:
    """The connection pool of Vigil's state client for any supported URL: a blocking pool of
    `max_connections`, TLS from `tls_options`, and for Sentinel one that asks the sentinels
    for the current master (and again after a failover). `connection_kwargs` (timeouts,
    health checks) apply to every Redis connection."""
    url = settings.redis_url
    if is_sentinel(url):
        user, password, db = credentials_and_db(url)
        sentinel = Sentinel(sentinel_addresses(url), sentinel_kwargs=sentinel_kwargs(settings),
                            **{k: v for k, v in connection_kwargs.items()
                               if k.startswith("socket_")})
        return BlockingSentinelConnectionPool(
            settings.redis_sentinel_master, sentinel, max_connections=max_connections,
            timeout=settings.redis_timeout, username=user, password=password, db=db,
            is_master=True, **connection_kwargs)
    return redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=settings.redis_timeout,
        **(tls_options(settings) or {}), **connection_kwargs)


def describe_failure(settings: VigilSettings, err: BaseException) -> str | None:
    """A one-line diagnosis for an error that retrying will not cure: Redis refused the
    credentials, or the TLS handshake failed (certificate, CA, key). None for anything else
    (Redis down or starting, a failover in progress), which is worth waiting for. The text
    names the setting to fix and the redacted URL only."""
    where = redacted_url(settings.redis_url)
    if isinstance(err, redis.AuthenticationError):
        return f"Redis at {where} refused the credentials ({type(err).__name__}: {err})"
    cause = err.__cause__ or err.__context__
    if isinstance(err, redis.ConnectionError) and isinstance(cause, ssl.SSLError):
        return (f"TLS handshake with Redis at {where} failed ({type(cause).__name__}: "
                f"{getattr(cause, 'reason', None) or cause}): check VIGIL_REDIS_TLS_CA_FILE, "
                "VIGIL_REDIS_TLS_CERT_FILE and VIGIL_REDIS_TLS_KEY_FILE")
    return None


def preflight(settings: VigilSettings, client: redis.Redis | None = None) -> None:
    """PING Redis once (on `client`, else on a new one, `connect`); raise SettingsError when it
    refuses the credentials or the TLS handshake fails (`describe_failure`), so a misconfigured
    process stops at once instead of retrying forever. An unreachable Redis passes: Celery
    waits for it at start."""
    try:
        (client or connect(settings)).ping()
    except (redis.ConnectionError, redis.TimeoutError) as e:
        why = describe_failure(settings, e)
        if why:
            raise SettingsError(f"invalid settings: VIGIL_REDIS_URL: {why}") from None


def answers_ping(url: str, timeout: float = 0.5) -> bool:
    """True when a Redis at `url` answers PING (connecting within `timeout` seconds); False
    while it cannot be reached or is still loading its data (a server being started,
    app/local/embedded.py). The client it pings on is closed before it returns."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def connect(settings: VigilSettings) -> redis.Redis:
    """A Redis client for Vigil's state with bounded timeouts (an unreachable Redis fails fast).

    The pool blocks (up to redis_timeout) instead of failing when every connection is busy:
    redis-py's default pool raises "Too many connections" past 100, and a worker's whole batch
    of task threads finishes in the same engine step.
    """
    # Any URL shape (password, TLS, Sentinel) goes through the one builder the broker and
    # backend options come from.
    pool = state_pool(
        settings,
        max_connections=settings.worker_concurrency + REDIS_POOL_HEADROOM,
        socket_timeout=settings.redis_timeout,
        socket_connect_timeout=settings.redis_timeout,
        health_check_interval=30,
    )
    return redis.Redis(connection_pool=pool)


def server_run_id(client: redis.Redis) -> str:
    """The running Redis server's run_id: a new one at every start. Raises redis' own errors."""
    return str(client.info("server")["run_id"])


def server_run(client: redis.Redis) -> tuple[str, float]:
    """The running Redis server's run_id (a new one at every start) and when it started (unix
    seconds, to the second). Raises redis' own errors (callers retry or wrap them)."""
    info = client.info("server")
    return str(info["run_id"]), time.time() - float(info["uptime_in_seconds"])


def async_client(settings: VigilSettings, *, max_connections: int = 64):
    """An asyncio Redis client (redis.asyncio) for Vigil's state, for the online API's event
    loop (app/state/live.py): the same endpoint, credentials, TLS and Sentinel master as
    `connect`, bounded timeouts, and a pool that waits (up to redis_timeout) for a free
    connection. Pub/sub connections it opens are its own, outside the pool's bound."""
    url = settings.redis_url
    kw = {"socket_connect_timeout": settings.redis_timeout, "health_check_interval": 30}
    if is_sentinel(url):
        user, password, db = credentials_and_db(url)
        sentinel = AsyncSentinel(sentinel_addresses(url),
                                 sentinel_kwargs=sentinel_kwargs(settings),
                                 socket_timeout=settings.redis_timeout,
                                 socket_connect_timeout=settings.redis_timeout)
        return sentinel.master_for(settings.redis_sentinel_master, redis_class=aioredis.Redis,
                                   username=user, password=password, db=db,
                                   max_connections=max_connections, **kw)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=settings.redis_timeout,
        **(tls_options(settings) or {}), **kw)
    return aioredis.Redis(connection_pool=pool)
