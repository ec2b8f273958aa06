"""Redis beyond one box (app/state/conn.py): password, TLS and Sentinel URLs for the broker, the
result backend and Vigil's state, from one set of settings; credentials never shown.

Unit tests for the URL rules and the Celery configuration; Redis-tier tests against private
redis-servers (tests/redis_servers.py): with `requirepass`, TLS-only with client certificates
from a CA made here, and a master + replica watched by `redis-server --sentinel`, failed over.
"""
from __future__ import annotations

import secrets
import ssl
import uuid

import pytest
import redis

from app.celery_app import create_app
from app.errors import REDIS_UNAVAILABLE, TransientError
from app.local.embedded import free_port, wait_for
from app.redis_url import redacted_url, sentinel_addresses
from app.settings import SettingsError, load_settings
from app.state.conn import connect, preflight
from app.state.store import RequestStore
from tests.redis_servers import (SENTINEL_MASTER, PrivateRedis, PrivateSentinel, make_tls_files,
                                 run_password)

PW = run_password()


# -- the URL rules (no Redis) ------------------------------------------------------------------
@pytest.mark.parametrize("url, shown", [
    (f"redis://:{PW}@10.0.0.5:6379/0", "redis://10.0.0.5:6379/0"),
    (f"rediss://vigil:{PW}@redis.internal:6380/2", "rediss://redis.internal:6380/2"),
    (f"sentinel://:{PW}@s1:26379/0;sentinel://:{PW}@s2:26380/0",
     "sentinel://s1:26379/0;sentinel://s2:26380/0"),
    (f"unix://:{PW}@/run/redis.sock?db=3", "unix:///run/redis.sock"),
    (f"redis://:{PW}@[broken/0", "(unparseable)"),
])
def test_redacted_url_drops_user_password_and_query_from_every_shape(url, shown):
    assert redacted_url(url) == shown


@pytest.mark.parametrize("overrides, var", [
    ({"redis_url": f"http://:{PW}@h:1/0"}, "VIGIL_REDIS_URL"),
    ({"redis_url": f"redis://:{PW}@h:notaport/0"}, "VIGIL_REDIS_URL"),
    ({"redis_url": f"sentinel://:{PW}@s1:26379;redis://:{PW}@s2"}, "VIGIL_REDIS_URL"),
    ({"redis_url": f"sentinel://:{PW}@s1:26379"}, "VIGIL_REDIS_SENTINEL_MASTER"),
    ({"redis_url": f"redis://:{PW}@h:1/0", "redis_sentinel_master": "m"},
     "VIGIL_REDIS_SENTINEL_MASTER"),
    ({"redis_url": f"redis://:{PW}@h:1/0", "redis_tls_ca_file": __file__},
     "VIGIL_REDIS_TLS_CA_FILE"),
    ({"redis_url": f"rediss://:{PW}@h:1/0", "redis_tls_key_file": __file__},
     "VIGIL_REDIS_TLS_KEY_FILE"),
    ({"redis_url": f"rediss://:{PW}@h:1/0", "redis_tls_ca_file": "/no/such/ca.pem"},
     "VIGIL_REDIS_TLS_CA_FILE"),
    ({"redis_url": "sentinel://s1:26379", "redis_sentinel_master": "m",
      "redis_sentinel_password": "x,y", "max_attempts": 0}, "VIGIL_MAX_ATTEMPTS"),
])
def test_a_bad_redis_setting_names_its_variable_and_never_shows_a_password(overrides, var):
    with pytest.raises(SettingsError) as e:
        load_settings(**overrides)
    assert var in str(e.value)
    assert PW not in str(e.value) and "x,y" not in str(e.value)


def test_the_settings_repr_hides_the_redis_url_and_the_sentinel_password():
    s = load_settings(redis_url=f"sentinel://:{PW}@s1:26379/0", redis_sentinel_master="m",
                      redis_sentinel_password=PW)
    assert PW not in repr(s) and PW not in str(s)


def test_sentinel_url_lists_every_sentinel():
    assert sentinel_addresses("sentinel://a:26379/0;sentinel://b/0") == [("a", 26379),
                                                                          ("b", 26379)]


def test_celery_gets_tls_and_sentinel_options_and_its_config_dump_hides_the_passwords(tmp_path):
    """Given rediss:// with a CA and a client certificate, the broker and the backend verify the
    server against that CA and present that certificate; given sentinel://, both know the master
    and the sentinels' password; `celery inspect conf` (humanize, censored) shows neither
    password."""
    tls = make_tls_files(tmp_path)
    c = create_app(load_settings(redis_url=f"rediss://:{PW}@h:6380/0",
                                 redis_tls_ca_file=tls.ca, redis_tls_cert_file=tls.client_cert,
                                 redis_tls_key_file=tls.client_key)).conf
    expect = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(tls.ca),
              "ssl_certfile": str(tls.client_cert), "ssl_keyfile": str(tls.client_key)}
    assert c.broker_use_ssl == c.redis_backend_use_ssl == expect
    assert "master_name" not in c.broker_transport_options
    assert PW not in c.humanize(censored=True)

    c = create_app(load_settings(redis_url=f"sentinel://:{PW}@s1:26379/0;sentinel://s2:26379/0",
                                 redis_sentinel_master="mymaster",
                                 redis_sentinel_password=PW)).conf
    for opts in (c.broker_transport_options, c.result_backend_transport_options):
        assert opts["master_name"] == "mymaster"
        assert opts["sentinel_kwargs"]["password"] == PW
        assert opts["visibility_timeout"] > 0  # Vigil's own options are still there
    assert c.broker_use_ssl is None and c.redis_backend_use_ssl is None
    assert PW not in c.humanize(censored=True)


# -- the Redis tier: real servers ------------------------------------------------------------
def three_clients_round_trip(settings) -> None:
    """Vigil's state client, the broker (kombu) and the result backend each write and read
    back through `settings`, as producers and workers use them."""
    tag = uuid.uuid4().hex
    client = connect(settings)
    client.set(f"vigil:test:{tag}", tag)
    assert client.get(f"vigil:test:{tag}") == tag.encode()
    app = create_app(settings)
    with app.connection_for_write() as conn:
        q = conn.SimpleQueue(f"vigil.test.{tag}")
        q.put({"tag": tag})
        msg = q.get(timeout=10)
        assert msg.payload == {"tag": tag}
        msg.ack()
        q.close()
    app.backend.store_result(tag, {"tag": tag}, "SUCCESS")
    assert app.backend.get_task_meta(tag)["result"] == {"tag": tag}


@pytest.fixture()
def password_redis():
    server = PrivateRedis(password=PW).start()
    yield server
    server.stop()


@pytest.mark.redis
def test_password_redis_serves_all_three_clients_and_a_wrong_password_fails_fast_typed(
        password_redis):
    """Given a redis-server with requirepass, when Vigil's settings carry the password, the
    state client, broker and backend all work; with a wrong one, a store call fails with
    TransientError(redis_unavailable) saying the credentials were refused, and the worker's
    preflight raises SettingsError naming VIGIL_REDIS_URL; neither shows either password."""
    three_clients_round_trip(load_settings(redis_url=password_redis.url()))

    wrong = "wrong-" + secrets.token_hex(4)
    bad = load_settings(redis_url=password_redis.url(password=wrong))
    with pytest.raises(TransientError) as e:
        RequestStore(connect(bad), 60).get("some-request")
    assert e.value.code == REDIS_UNAVAILABLE and "refused the credentials" in str(e.value)
    with pytest.raises(SettingsError) as s:
        preflight(bad)  # on a client of its own, as `vigil worker` calls it
    assert "VIGIL_REDIS_URL" in str(s.value) and "refused the credentials" in str(s.value)
    for text in (str(e.value), str(s.value)):
        assert wrong not in text and PW not in text


@pytest.mark.redis
def test_preflight_lets_an_unreachable_redis_pass_for_celery_to_wait_on():
    """Given nothing listening at VIGIL_REDIS_URL, the preflight raises nothing (a worker
    started before Redis waits for it, as Celery does)."""
    s = load_settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout=0.5)
    preflight(s, connect(s))


@pytest.mark.redis
def test_tls_redis_serves_all_three_clients_and_a_missing_ca_is_a_clear_settings_error(
        tmp_path):
    """Given a TLS-only redis-server that requires client certificates, signed by a CA made
    here, when the settings name the CA and the client certificate, the three clients work over
    rediss://; without the CA (the system's trust store does not know it) the preflight raises
    SettingsError naming the TLS settings."""
    tls = make_tls_files(tmp_path)
    server = PrivateRedis(password=PW, tls=tls).start()
    try:
        good = load_settings(redis_url=server.url(), redis_tls_ca_file=tls.ca,
                             redis_tls_cert_file=tls.client_cert,
                             redis_tls_key_file=tls.client_key)
        three_clients_round_trip(good)
        preflight(good, connect(good))

        no_ca = load_settings(redis_url=server.url(), redis_tls_cert_file=tls.client_cert,
                              redis_tls_key_file=tls.client_key, redis_timeout=2)
        with pytest.raises(SettingsError) as e:
            preflight(no_ca, connect(no_ca))
        assert "TLS handshake" in str(e.value) and "VIGIL_REDIS_TLS_CA_FILE" in str(e.value)
        assert PW not in str(e.value)
    finally:
        server.stop()


@pytest.mark.redis
def test_sentinel_url_serves_all_three_clients_and_the_state_client_follows_a_failover():
    """Given a password-protected master with one replica, watched by a sentinel that has its
    own password, and a sentinel URL that lists a dead sentinel first: the three clients work
    through the sentinel URL. When the master is SIGKILLed, the sentinel promotes the replica,
    and the same state client (its pool asks the sentinels again) reads what was written before
    the kill and writes to the new master."""
    sentinel_pw = "sentinel-" + secrets.token_hex(4)
    master = PrivateRedis(password=PW).start()
    replica = PrivateRedis(password=PW, replica_of=master).start()
    sentinel = PrivateSentinel(master, password=sentinel_pw).start()
    try:
        url = (f"sentinel://:{PW}@127.0.0.1:{free_port()}/0;"
               f"{sentinel.address.replace('sentinel://', f'sentinel://:{PW}@')}/0")
        s = load_settings(redis_url=url, redis_sentinel_master=SENTINEL_MASTER,
                          redis_sentinel_password=sentinel_pw, redis_timeout=2)
        three_clients_round_trip(s)

        client = connect(s)
        wait_for(lambda: replica.client().info("replication")["master_link_status"] == "up",
                 30, 0.1, "the replica to sync")
        client.set("vigil:test:before-failover", "kept")
        assert client.wait(1, 5000) == 1  # the replica has it: failover cannot lose it
        master.kill()
        wait_for(lambda: sentinel.master_address() == ("127.0.0.1", replica.port), 60, 0.2,
                 "the sentinel to promote the replica")

        def served_by_new_master():
            try:
                return client.get("vigil:test:before-failover")
            except redis.ConnectionError:  # old connections drop once, then the pool re-asks
                return None

        assert wait_for(served_by_new_master, 30, 0.2, "the state client to follow") == b"kept"
        client.set("vigil:test:after-failover", "written")
        assert replica.client().get("vigil:test:after-failover") == b"written"
    finally:
        for server in (sentinel, replica, master):
            server.stop()
