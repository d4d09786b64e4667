"""Mosquitto as ``deploy/mosquitto/`` ships it, started by tests: certificates, passwords, blocking checks.

:func:`production_broker` runs ``production.conf`` with the shipped ACL, a password per user, a test CA's
server certificate on the TLS listener and client certificates for the certificate listener; the ports
are free ones of 127.0.0.1. :func:`site_broker_conf` is a site broker (``dev.conf``) with ``bridge.conf``
pointed at such a broker as its cloud, for one of the sites the shipped ACL names. :class:`Client` is a blocking
MQTT 5 client whose publish returns the PUBACK reason code, so a test sees what the broker refused.
:func:`role_config` is a service's, the operator's or a device's configuration on such a broker, with its own
credentials.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import queue
import re
import subprocess
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from helpers import require_binary
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.reasoncodes import ReasonCode

from edgemesh.common.acl import OPERATOR, SERVICES, SITES, bridge_client_id, bridge_state_topic, bridge_user
from edgemesh.common.config import BrokerConfig, Config, load_config
from edgemesh.common.errors import BrokerError
from edgemesh.common.topics import site_prefix
from edgemesh.local.broker import free_port, wait_port
from edgemesh.local.processes import parent_death_signal

ROOT = Path(__file__).resolve().parents[1]
MOSQUITTO_DIR = ROOT / "deploy" / "mosquitto"
WAIT_S = 10.0
DEVICES = ("pi-01", "pi-02", "pi-03")
USERS = (*SERVICES, OPERATOR, *DEVICES, *(bridge_user(site) for site in SITES))
"""The password file's users: the services, the operator, three devices and the bridges of the ACL's sites."""
CERT_DEVICE = "pi-cert"
"""The device that logs in with a client certificate (its common name) on the certificate listener."""


def mosquitto_password_line(user: str, password: str) -> str:
    """A password_file line in Mosquitto's ``$6$`` format (salted SHA-512), as mosquitto_passwd -H sha512 writes."""
    salt = os.urandom(12)
    digest = hashlib.sha512(password.encode() + salt).digest()
    return f"{user}:$6${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}\n"


def rewrite(conf: str, pattern: str, replacement: str) -> str:
    """Replace the one line matching ``pattern`` (anchored, multiline); fail if it is not there exactly once."""
    new, count = re.subn(rf"^{pattern}$", replacement, conf, flags=re.MULTILINE)
    assert count == 1, f"expected one line matching {pattern!r}, found {count}"
    return new


@contextlib.contextmanager
def mosquitto(conf: str, directory: Path, ports: list[int]) -> Iterator[Path]:
    """Run Mosquitto on ``conf`` until the block ends; yields its log file.

    Waits until every port accepts connections and fails with the log if Mosquitto exits.
    As root, Mosquitto would switch to the mosquitto user and lose the parent-death
    signal; ``user root`` keeps it (as BrokerProcess does).
    """
    binary = require_binary("mosquitto")
    if os.geteuid() == 0:
        conf += "\nuser root\n"
    directory.mkdir(parents=True, exist_ok=True)
    conf_path = directory / "mosquitto.conf"
    conf_path.write_text(conf)
    log_path = directory / "mosquitto.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([binary, "-c", str(conf_path)], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=parent_death_signal())
    try:
        for port in ports:
            try:
                wait_port("127.0.0.1", port, WAIT_S)
            except BrokerError:
                pytest.fail(f"mosquitto (exit code {proc.poll()}) did not listen on {port}:\n{log_path.read_text()}")
        yield log_path
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Client:
    """A blocking MQTT 5 client for broker checks: publish returns the PUBACK reason code."""

    def __init__(self, port: int, user: str | None = None, password: str | None = None,
                 ca: Path | None = None, cert: tuple[Path, Path] | None = None) -> None:
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._connack: queue.Queue[ReasonCode] = queue.Queue()
        self._subacks: queue.Queue[int] = queue.Queue()
        self._pubacks: dict[int, ReasonCode] = {}
        self.mqtt = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"test-{user}-{uuid.uuid4().hex[:6]}",
                                protocol=mqtt.MQTTv5)
        if user is not None:
            self.mqtt.username_pw_set(user, password)
        if ca is not None:
            certfile, keyfile = (str(cert[0]), str(cert[1])) if cert else (None, None)
            self.mqtt.tls_set(ca_certs=str(ca), certfile=certfile, keyfile=keyfile)
        self.mqtt.on_connect = lambda c, u, flags, rc, props: self._connack.put(rc)
        self.mqtt.on_subscribe = lambda c, u, mid, rcs, props: self._subacks.put(mid)
        self.mqtt.on_publish = lambda c, u, mid, rc, props: self._pubacks.__setitem__(mid, rc)
        self.mqtt.on_message = lambda c, u, msg: self.messages.put((msg.topic, msg.payload))
        try:
            self.mqtt.connect("127.0.0.1", port)
        except OSError as exc:  # a TLS handshake the broker ends (no client certificate where one is required)
            self.reason = ReasonCode(mqtt.PacketTypes.CONNACK, "Not authorized")
            self.error: OSError | None = exc
            return
        self.error = None
        self.mqtt.loop_start()
        try:
            self.reason = self._connack.get(timeout=WAIT_S)
        except queue.Empty:  # the broker closed the connection without a CONNACK
            self.reason = ReasonCode(mqtt.PacketTypes.CONNACK, "Not authorized")

    def subscribe(self, *filters: str) -> None:
        for f in filters:
            _, mid = self.mqtt.subscribe(f, qos=1)
            while self._subacks.get(timeout=WAIT_S) != mid:
                pass

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> ReasonCode:
        info = self.mqtt.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(WAIT_S)
        assert info.is_published(), f"no PUBACK for {topic}"
        return self._pubacks.pop(info.mid)

    def next_message(self) -> tuple[str, bytes]:
        return self.messages.get(timeout=WAIT_S)

    def close(self) -> None:
        if self.error is None:
            self.mqtt.disconnect()
            self.mqtt.loop_stop()


@dataclass
class ProductionBroker:
    tls_port: int
    plain_port: int
    cert_port: int
    directory: Path
    log: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    @staticmethod
    def password(user: str) -> str:
        return f"{user}-secret"

    def client_cert(self, name: str) -> tuple[Path, Path]:
        """The certificate and key of client ``name`` (made by :func:`make_certificates`)."""
        return self.directory / f"{name}.crt", self.directory / f"{name}.key"

    def client(self, user: str, *, tls: bool = True) -> Client:
        if tls:
            client = Client(self.tls_port, user, self.password(user), ca=self.ca)
        else:
            client = Client(self.plain_port, user, self.password(user))
        assert not client.reason.is_failure, f"{user}: {client.reason}\n{self.log.read_text()}"
        return client

    def broker_config(self, user: str, *, tls: bool = True, **settings: object) -> BrokerConfig:
        """How ``user`` reaches the broker: over TLS with its password (devices), or over loopback (services)."""
        if tls:
            return BrokerConfig(url=f"mqtts://127.0.0.1:{self.tls_port}", username=user,
                                password=self.password(user), ca_file=str(self.ca), **settings)  # type: ignore[arg-type]
        return BrokerConfig(url=f"mqtt://127.0.0.1:{self.plain_port}", username=user,
                            password=self.password(user), **settings)  # type: ignore[arg-type]


def make_certificates(directory: Path, clients: Iterable[str] = ()) -> None:
    """A test CA, a server certificate for 127.0.0.1 / localhost, and one client certificate per name in
    ``clients`` (its common name); EC keys: fast."""
    openssl = require_binary("openssl")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (directory / "server.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    (directory / "client.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n")
    commands = [
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=edgemesh-test-ca",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ["req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.crt", "-days", "2", "-extfile", "server.ext"],
    ]
    for name in clients:
        commands += [
            ["req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}"],
            ["x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", "client.ext"],
        ]
    for command in commands:
        subprocess.run([openssl, *command], cwd=directory, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def production_broker(directory: Path, users: Iterable[str] = USERS) -> Iterator[ProductionBroker]:
    """deploy/mosquitto/production.conf and acl, with test certificates, passwords and ports."""
    make_certificates(directory, [CERT_DEVICE])
    passwd = directory / "passwd"
    passwd.write_text("".join(mosquitto_password_line(u, ProductionBroker.password(u)) for u in users))
    tls_port, plain_port, cert_port = free_port(), free_port(), free_port()
    conf = (MOSQUITTO_DIR / "production.conf").read_text()
    conf = rewrite(conf, "listener 8883", f"listener {tls_port} 127.0.0.1")
    conf = rewrite(conf, r"listener 1883 127\.0\.0\.1", f"listener {plain_port} 127.0.0.1")
    conf = rewrite(conf, "listener 8884", f"listener {cert_port} 127.0.0.1")
    for key, value in (("cafile", directory / "ca.crt"), ("certfile", directory / "server.crt"),
                       ("keyfile", directory / "server.key")):
        conf = re.sub(rf"^{key} \S+$", f"{key} {value}", conf, flags=re.MULTILINE)  # one per TLS listener
    for key, value in (("password_file", passwd), ("acl_file", MOSQUITTO_DIR / "acl")):
        conf = rewrite(conf, rf"{key} \S+", f"{key} {value}")
    with mosquitto(conf, directory, [tls_port, plain_port, cert_port]) as log:
        yield ProductionBroker(tls_port, plain_port, cert_port, directory, log)


@dataclass(frozen=True)
class SiteBroker:
    """A site broker's configuration: ``dev.conf`` on ``port`` plus ``bridge.conf`` to a cloud broker."""

    conf: str
    port: int
    site: str
    state_topic: str
    """Where the bridge reports itself connected (``1``) or not (``0``), retained on the site broker."""

    @property
    def prefix(self) -> str:
        """What comes before this site's topics on the cloud broker (``broker.topic_prefix`` there)."""
        return site_prefix(self.site)


SHIPPED_SITE = SITES[0]
"""The site bridge.conf is written for (its topic line, remote_clientid and remote_username)."""


def site_broker_conf(cloud: ProductionBroker, site: str = SHIPPED_SITE) -> SiteBroker:
    """deploy/mosquitto/dev.conf on a free port with deploy/mosquitto/bridge.conf appended, its address, CA and
    password pointed at ``cloud``'s TLS listener, for ``site`` (everything else as shipped: another site as the
    file says, its name in the topic line's prefix, its client id and its user)."""
    port = free_port()
    conf = rewrite((MOSQUITTO_DIR / "dev.conf").read_text(), r"listener 1883 127\.0\.0\.1",
                   f"listener {port} 127.0.0.1")
    bridge = (MOSQUITTO_DIR / "bridge.conf").read_text()
    for key, named in (('topic edgemesh/v1/# both 1 ""', site_prefix), ("remote_clientid", bridge_client_id),
                       ("remote_username", bridge_user)):
        bridge = rewrite(bridge, re.escape(f"{key} {named(SHIPPED_SITE)}"), f"{key} {named(site)}")
    bridge = rewrite(bridge, r"address \S+", f"address 127.0.0.1:{cloud.tls_port}")
    bridge = rewrite(bridge, r"bridge_cafile \S+", f"bridge_cafile {cloud.ca}")
    bridge = rewrite(bridge, r"remote_password \S+", f"remote_password {ProductionBroker.password(bridge_user(site))}")
    return SiteBroker(conf + "\n" + bridge, port, site, bridge_state_topic(site))


def role_config(broker: ProductionBroker, user: str, job: str, **settings: object) -> Config:
    """``user``'s configuration for ``job`` on ``broker``, as the systemd units run them: a service or the operator
    over loopback, a device over TLS as its own name (``worker.device``), each with its password; quick reconnects,
    metrics on a free port; then ``settings`` (dotted keys)."""
    device = user not in (*SERVICES, OPERATOR)
    config = broker.broker_config(user, tls=device)
    overrides: dict[str, object] = {
        "job": job, "broker.url": config.url, "broker.username": user, "broker.password": config.password,
        "broker.ca_file": config.ca_file, "broker.backoff_initial_s": 0.05, "broker.backoff_max_s": 0.5,
        "metrics.address": "127.0.0.1:0", **({"worker.device": user} if device else {}), **settings}
    return load_config(env={}, overrides={k: str(v) for k, v in overrides.items()})
