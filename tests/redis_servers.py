"""Private redis-servers of the kinds a fleet beyond one box uses: password, TLS, Sentinel.

Each runs the Debian `redis-server` binary on free loopback ports in its own process group and
data directory (app/local/embedded.py's rules: stopped TERM then KILL, directory removed). The TLS
material is made per test with the `cryptography` package: a self-signed CA, a server
certificate for 127.0.0.1/localhost and a client certificate, all signed by that CA.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import redis

from app.local.embedded import (EmbeddedRedis, free_port, redis_server_path, stop_process,
                                wait_for)

SENTINEL_MASTER = "vigil-test-master"


def run_password(prefix: str = "hunter2") -> str:
    """A password no log should ever show, the same in every process of one run (pytest-xdist's
    processes must collect the same test ids, and a password is part of some), new each run."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or secrets.token_hex(6)
    return f"{prefix}-{run[:12]}"


class LocalRedis(EmbeddedRedis):
    """app/local's private redis-server, with a plain client for the tests that look at Redis
    directly (a witness outside the code it checks); the harness itself hands out none."""

    def client(self) -> redis.Redis:
        """A new client on this server."""
        return redis.Redis.from_url(self.url)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a test PKI: the CA, the server's pair and a client's pair."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """Write a self-signed CA and a server and client certificate signed by it into `directory`.
    The server certificate names 127.0.0.1 and localhost, so hostname checks pass on loopback."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key, path: Path) -> Path:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        return path

    def write_cert(cert, path: Path) -> Path:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("vigil test CA"))
          .issuer_name(name("vigil test CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, usage, san: list | None):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                 ca_key.public_key()), critical=False))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(ca_key, hashes.SHA256()), key

    server, server_key = leaf("127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH,
                              [x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                               x509.DNSName("localhost")])
    client, client_key = leaf("vigil client", ExtendedKeyUsageOID.CLIENT_AUTH, None)
    directory.mkdir(parents=True, exist_ok=True)
    return TlsFiles(ca=write_cert(ca, directory / "ca.pem"),
                    server_cert=write_cert(server, directory / "server.pem"),
                    server_key=write_key(server_key, directory / "server.key"),
                    client_cert=write_cert(client, directory / "client.pem"),
                    client_key=write_key(client_key, directory / "client.key"))


class PrivateRedis:
    """A private redis-server on a free loopback port: optionally with a password
    (`requirepass`), TLS only (`tls-port`, client certificates required), or as a replica."""

    def __init__(self, password: str | None = None, tls: TlsFiles | None = None,
                 replica_of: "PrivateRedis | None" = None):
        self.port = free_port()
        self.password, self.tls, self.replica_of = password, tls, replica_of
        self.dir = Path(tempfile.mkdtemp(prefix="vigil-redis-"))
        self.proc: subprocess.Popen | None = None

    def url(self, db: int = 0, password: str | None = None) -> str:
        """This server's URL (rediss:// with TLS), with `password` (default: the real one)."""
        pw = self.password if password is None else password
        auth = f":{pw}@" if pw else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/{db}"

    def client(self) -> redis.Redis:
        """A direct redis-py client with the right credentials (for checks, not for Vigil)."""
        kw: dict = {"host": "127.0.0.1", "port": self.port, "password": self.password,
                    "socket_connect_timeout": 1}
        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=str(self.tls.ca), ssl_certfile=str(self.tls.client_cert),
                      ssl_keyfile=str(self.tls.client_key))
        return redis.Redis(**kw)

    def start(self, timeout: float = 10) -> "PrivateRedis":
        """Start the server and wait until it answers PING."""
        args = [redis_server_path(), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", str(self.tls.server_cert),
                     "--tls-key-file", str(self.tls.server_key),
                     "--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "yes"]
        else:
            args += ["--port", str(self.port)]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.replica_of:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of.port)]
        self.proc = _spawn(args, self.dir / "redis.log")
        client = self.client()
        wait_for(lambda: _ping(client), timeout, what=f"redis-server on port {self.port}")
        return self

    def kill(self) -> None:
        """SIGKILL the server (a crashed master), keeping its data dir."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """Stop the server and remove its data dir."""
        stop_process(self.proc, timeout=10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateSentinel:
    """`redis-server --sentinel` watching `master` under SENTINEL_MASTER (quorum 1), with a short
    down-after so a killed master is failed over within seconds; optionally with its own
    password (`requirepass` in sentinel.conf)."""

    def __init__(self, master: PrivateRedis, password: str | None = None,
                 down_after_ms: int = 1000):
        self.port = free_port()
        self.master, self.password, self.down_after_ms = master, password, down_after_ms
        self.dir = Path(tempfile.mkdtemp(prefix="vigil-sentinel-"))
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """`sentinel://127.0.0.1:PORT`: one entry of a Vigil sentinel URL."""
        return f"sentinel://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        """A direct client of the sentinel itself (SENTINEL commands)."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_connect_timeout=1)

    def start(self, timeout: float = 10) -> "PrivateSentinel":
        """Write the sentinel's config (it rewrites it as it learns), start it, wait until it
        knows the master and its replicas' count is settled enough to answer."""
        conf = self.dir / "sentinel.conf"
        lines = [f"port {self.port}", "bind 127.0.0.1", f"dir {self.dir}",
                 f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {self.master.port} 1",
                 f"sentinel down-after-milliseconds {SENTINEL_MASTER} {self.down_after_ms}",
                 f"sentinel failover-timeout {SENTINEL_MASTER} 10000"]
        if self.master.password:
            lines.append(f"sentinel auth-pass {SENTINEL_MASTER} {self.master.password}")
        if self.password:
            lines.append(f"requirepass {self.password}")
        conf.write_text("\n".join(lines) + "\n")
        self.proc = _spawn([redis_server_path(), str(conf), "--sentinel", "--loglevel",
                            "warning"], self.dir / "sentinel.log")
        client = self.client()
        wait_for(lambda: self.master_address(client), timeout,
                 what=f"sentinel on port {self.port} to know its master")
        return self

    def master_address(self, client: redis.Redis | None = None) -> tuple[str, int] | None:
        """The master's (host, port) as this sentinel reports it, or None."""
        try:
            got = (client or self.client()).sentinel_get_master_addr_by_name(SENTINEL_MASTER)
        except redis.RedisError:
            return None
        if not got:
            return None
        host = got[0].decode() if isinstance(got[0], bytes) else got[0]
        return host, int(got[1])

    def stop(self) -> None:
        """Stop the sentinel and remove its directory."""
        stop_process(self.proc, timeout=10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    # Output to a file, never to the caller's pipes: a server outliving a crashed test would
    # otherwise hold them open.
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, process_group=0)


def _ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
