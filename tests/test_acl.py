"""The broker's ACL, role by role (``edgemesh.common.acl``, deploy/mosquitto/acl, docs/deployment.md).

* The shipped ACL is the one the table makes, docs/deployment.md shows the table, and bridge.conf is the bridge of
  the table's first site. The topics it rests on: a device answers commands on a topic that ends in its name (and a
  reply there from anyone else is refused), the topics of every job as filters, a site's prefix.
* The table says what a user relies on (``NAMED``): the operator alone steers; a device writes as itself and
  answers commands as itself, reads its own acks, model parts, codec policy and the backward slices sent to it; a
  sharded parameter server's shards trade steps and norms; a site's bridge reaches its own prefix alone.
* On the shipped production broker (tests/production.py), Mosquitto does what the table says for every role and
  every topic some role is granted (each instantiated for two devices, a service's name, both sites), both ways: a
  publish is acknowledged exactly when the table grants it (the MQTT 5 PUBACK's reason code) and reaches the
  operator; a client subscribed to everything receives exactly what the table lets it read. That something did NOT
  arrive is known once a later marker did: Mosquitto queues a message for its subscribers before it answers the
  publisher's PUBACK, so whatever was acknowledged before the marker was published reaches a subscriber first.
* A sharded parameter server (two shards, ``clip``: norms and steps) trains under the shipped ACL with a planner,
  a compressor and two devices, each with its own credentials: nothing refused, nothing missed, the model's version
  advances on both shards.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import SPLIT, mesh_plan, running, until
from production import (
    DEVICES,
    SHIPPED_SITE,
    Client,
    ProductionBroker,
    production_broker,
    role_config,
)

from edgemesh.common.acl import (
    OPERATOR,
    SERVICES,
    SITES,
    USER,
    Access,
    allows,
    bridge_client_id,
    bridge_user,
    markdown,
    render,
    roles,
)
from edgemesh.common.bus import Bus
from edgemesh.common.config import BrokerConfig
from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import ControlReply
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import ANY, PREFIX, SITES_SEGMENT, EveryJob, TopicMatch, Topics, parse, site_prefix
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.service import Worker

ROOT = Path(__file__).resolve().parents[1]
TABLE = roles()
JOB = "acl"
OTHER = "x"
"""What any other ``+`` or ``#`` of a grant stands for in the topics published."""
OWN_NAMES = ("pi-01", "pi-02", "planner")
"""Who ``%u`` stands for: two devices, and a service (pattern lines are every user's)."""
PLAYERS = (*SERVICES, OPERATOR, "pi-01", "pi-02", *(bridge_user(site) for site in SITES))
"""The users whose publishes and reads are checked."""
T = Topics(JOB)
SHARD_1 = T.for_shard(1)
SITE_1, SITE_2 = (site_prefix(site) for site in SITES)
ACCESSES: tuple[Access, ...] = ("publish", "read")

NAMED: list[tuple[str, Access, str, bool]] = [
    # the operator alone steers: services, devices and jobs
    (OPERATOR, "publish", T.control("ps"), True),
    (OPERATOR, "publish", T.control("device/pi-01"), True),
    (OPERATOR, "publish", T.control("job"), True),
    ("pi-01", "publish", T.control("ps"), False),
    ("pi-01", "publish", T.control("all"), False),
    ("pi-01", "publish", T.control("device/pi-01"), False),
    ("pi-01", "publish", T.control("job"), False),
    ("ps", "publish", T.control("all"), False),
    ("planner", "publish", T.control("ps"), False),
    ("compressor", "publish", T.control("job"), False),
    (OPERATOR, "publish", T.model(), False),
    # a device writes as itself: hello, gradients, slices, requests, answers
    ("pi-01", "publish", T.hello("pi-01"), True),
    ("pi-01", "publish", T.status("pi-02"), False),
    ("pi-01", "publish", T.grad("c-pi-01", "pi-01"), True),
    ("pi-01", "publish", T.grad("c-pi-02", "pi-02"), False),
    ("pi-01", "publish", SHARD_1.grad("c-pi-01", "pi-01"), True),
    ("pi-01", "publish", SHARD_1.grad("c-pi-02", "pi-02"), False),
    ("pi-01", "publish", T.mesh_backward("m-pi-01", "conv2", "pi-02", "pi-01"), True),
    ("pi-01", "publish", T.mesh_backward("m-pi-01", "conv2", "pi-01", "pi-02"), False),
    ("pi-01", "publish", T.mesh("m-pi-01", "conv1", "fwd", "pi-02"), False),
    ("pi-01", "publish", T.snapshot_request("pi-02"), False),
    ("pi-01", "publish", T.device_reply(T.control_reply("ctl-1234"), "pi-01"), True),
    ("pi-01", "publish", T.device_reply(T.control_reply("ctl-1234"), "pi-02"), False),
    ("pi-01", "publish", T.control_reply("ctl-1234"), False),  # a service's answer
    ("ps", "publish", T.control_reply("ctl-1234"), True),
    ("pi-01", "publish", T.plan(), False),
    ("pi-01", "publish", T.model(), False),
    ("pi-01", "publish", T.ack("pi-01"), False),
    ("pi-01", "publish", T.job_file(), False),
    ("pi-01", "publish", T.job_state(), False),
    # a device reads its own: acks, codec policy, part of a delta, backward slices, control commands
    ("pi-01", "read", T.ack("pi-01"), True),
    ("pi-01", "read", T.ack("pi-02"), False),
    ("pi-01", "read", SHARD_1.ack("pi-02"), False),
    ("pi-01", "read", T.codec("pi-02"), False),
    ("pi-01", "read", T.model_delta_for("pi-01"), True),
    ("pi-01", "read", T.model_delta_for("pi-02"), False),
    ("pi-01", "read", SHARD_1.model_delta_for("pi-02"), False),
    ("pi-01", "read", T.mesh_backward("m-pi-02", "conv1", "pi-01", "pi-03"), True),
    ("pi-01", "read", T.mesh_backward("m-pi-02", "conv1", "pi-02", "pi-03"), False),
    ("pi-01", "read", T.mesh("m-pi-02", "conv1", "fwd", "pi-02"), True),  # not addressed: every cluster's
    ("pi-01", "read", T.control("device/pi-01"), True),
    ("pi-01", "read", T.control("device/pi-02"), False),
    ("pi-01", "read", T.control("ps"), False),
    ("pi-01", "read", T.device_reply(T.control_reply("ctl-1234"), "pi-02"), False),
    ("pi-01", "read", T.sync(), False),
    ("pi-01", "read", T.job_model(), False),
    # services: their own topics
    ("ps", "publish", T.plan(), False),
    ("planner", "publish", T.model(), False),
    ("compressor", "publish", T.ack("pi-01"), False),
    ("planner", "read", T.sync(), True),
    # a sharded parameter server: shard 0's steps, the others' norms, every shard's model, acks and updates
    ("ps", "publish", T.steps(), True),
    ("ps", "read", T.steps(), True),
    ("ps", "publish", SHARD_1.norms(), True),
    ("ps", "read", SHARD_1.norms(), True),
    ("ps", "publish", SHARD_1.ack("pi-01"), True),
    ("ps", "read", SHARD_1.grad("c-pi-01", "pi-01"), True),
    ("ps", "read", SHARD_1.model(), True),
    ("pi-01", "publish", T.steps(), False),
    ("pi-01", "publish", SHARD_1.norms(), False),
    # a site's bridge: its own prefix alone, both ways; the cloud's services and operator every site's
    (bridge_user(SITES[0]), "publish", SITE_1 + T.control("ps"), True),
    (bridge_user(SITES[0]), "publish", SITE_2 + T.control("ps"), False),
    (bridge_user(SITES[0]), "publish", SITE_2 + T.control("job"), False),
    (bridge_user(SITES[0]), "publish", T.control("ps"), False),
    (bridge_user(SITES[0]), "publish", T.hello("pi-01"), False),
    (bridge_user(SITES[0]), "read", SITE_2 + T.plan(), False),
    (bridge_user(SITES[0]), "read", T.control("ps"), False),
    (bridge_user(SITES[0]), "read", T.plan(), True),  # pattern lines are every user's: the cloud's own jobs' plan
    (bridge_user(SITES[1]), "publish", SITE_1 + T.hello("pi-01"), False),
    ("planner", "publish", SITE_2 + T.plan(), True),
    (OPERATOR, "publish", SITE_2 + T.control("ps"), True),
    ("pi-01", "publish", SITE_1 + T.hello("pi-01"), False),  # a device of the cloud broker is none of a site's
]
"""(user, publish or read, topic, whether the table allows it)."""


@pytest.mark.parametrize(("user", "access", "topic", "allowed"), NAMED)
def test_the_table_grants_what_a_role_needs_and_refuses_what_it_must_not(user: str, access: Access, topic: str,
                                                                          allowed: bool) -> None:
    assert allows(TABLE, user, access, topic) is allowed


def test_the_shipped_acl_is_the_one_the_table_makes() -> None:
    assert (ROOT / "deploy" / "mosquitto" / "acl").read_text() == render(TABLE), \
        "regenerate it: python -m edgemesh.common.acl > deploy/mosquitto/acl"


def test_the_deployment_docs_show_the_table() -> None:
    assert markdown(TABLE) in (ROOT / "docs" / "deployment.md").read_text(), \
        "python -m edgemesh.common.acl --markdown: the table of docs/deployment.md"


def test_the_shipped_bridge_is_the_first_sites_under_its_prefix() -> None:
    conf = (ROOT / "deploy" / "mosquitto" / "bridge.conf").read_text()
    for line in (f'topic {PREFIX}/# both 1 "" {site_prefix(SHIPPED_SITE)}',
                 f"remote_clientid {bridge_client_id(SHIPPED_SITE)}", f"remote_username {bridge_user(SHIPPED_SITE)}"):
        assert re.search(f"^{re.escape(line)}$", conf, re.MULTILINE), line


# --------------------------------------------------------------------------- the topics it rests on


def test_a_device_answers_on_a_topic_that_names_it_and_only_its_answers_are_taken_there() -> None:
    mine = T.device_reply(T.control_reply("ops"), "pi-01")
    assert mine == T.control_reply("ops") + "/pi-01"
    assert parse(mine) == TopicMatch(JOB, "reply", mine, device="pi-01", target="ops")
    answers = T.reply_filter("ops")
    assert answers.matches(mine) and answers.matches(T.control_reply("ops"))  # a device's, and a service's
    assert not answers.matches(T.device_reply(T.control_reply("ops2"), "pi-01"))

    def reply(source: str) -> ControlReply:
        return ControlReply(request_id="r", source=source, command="status", ok=True)

    assert parse(mine).disagreement(reply("device/pi-01")) is None
    assert "source" in (parse(mine).disagreement(reply("device/pi-02")) or "")
    assert "source" in (parse(mine).disagreement(reply("ps")) or "")
    assert parse(T.control_reply("ops")).disagreement(reply("ps")) is None


def test_every_jobs_topics_are_filters_with_a_wildcard_job() -> None:
    every, shards = EveryJob(), EveryJob(every_shard=True)
    assert every.grad(ANY, USER) == f"{PREFIX}/+/grad/+/%u"
    assert shards.ack(USER) == f"{PREFIX}/+/shard/+/ack/%u"
    assert every.steps() == shards.steps() == f"{PREFIX}/+/shard/0/steps"  # shard 0's alone
    assert every.norms_filter().pattern == shards.norms() == f"{PREFIX}/+/shard/+/norms"
    assert every.control(f"device/{USER}") == f"{PREFIX}/+/control/device/%u"


def test_a_sites_prefix_is_a_level_of_its_name_and_a_topic_prefix_is_checked() -> None:
    assert site_prefix("site1") == "sites/site1/" and site_prefix(ANY) == "sites/+/"
    with pytest.raises(ValueError, match="site"):
        site_prefix("a/b")
    assert BrokerConfig(topic_prefix=site_prefix("site1")).topic_prefix == "sites/site1/"
    for bad in ("sites/+/", "sites/site1", "/sites/site1/", "$SYS/", "sites/#/"):
        with pytest.raises(ConfigError, match="broker.topic_prefix"):
            BrokerConfig(topic_prefix=bad)


# --------------------------------------------------------------------------- on the shipped broker


def instances(filter_: str) -> set[str]:
    """Topics ``filter_`` covers: ``%u`` each of ``OWN_NAMES``, a site's ``+`` each site, a job's ``JOB``, any
    other ``+`` or ``#`` ``OTHER``."""
    levels = filter_.split("/")
    options: list[tuple[str, ...]] = []
    for i, level in enumerate(levels):
        if level == USER:
            options.append(OWN_NAMES)
        elif level == ANY and levels[i - 1:i] == [SITES_SEGMENT]:
            options.append(SITES)
        elif level == ANY and "/".join(levels[max(0, i - 2):i]) == PREFIX:
            options.append((JOB,))
        elif level in (ANY, "#"):
            options.append((OTHER,))
        else:
            options.append((level,))
    return {"/".join(topic) for topic in itertools.product(*options)}


TOPICS = sorted({topic for role in TABLE for access in ACCESSES for f in role.filters(access) for topic in instances(f)}
                | {topic for _, _, topic, _ in NAMED})
"""Every topic some role is granted, instantiated, and the named ones."""


def test_the_topics_checked_on_the_broker_cover_every_grant() -> None:
    for role in TABLE:
        for access in ACCESSES:
            for filter_ in role.filters(access):
                users = OWN_NAMES if role.device else (role.user,)
                assert any(allows(TABLE, user, access, t) for t in TOPICS for user in users), (role.user, filter_)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProductionBroker]:
    """The shipped production broker on free ports of 127.0.0.1."""
    with production_broker(tmp_path_factory.mktemp("acl")) as broker:
        yield broker


def player(broker: ProductionBroker, user: str) -> Client:
    """``user``'s client: a device over TLS, a service, the operator or a bridge over loopback."""
    return broker.client(user, tls=user in DEVICES)


def received_before(client: Client, marker: bytes) -> list[str]:
    """The topics of what ``client`` receives up to the message ``marker`` (markers of others skipped)."""
    topics = []
    while (message := client.next_message())[1] != marker:
        if not message[1].startswith(b"marker"):
            topics.append(message[0])
    return topics


def test_mosquitto_takes_every_publish_the_table_grants_and_refuses_every_other(shipped: ProductionBroker) -> None:
    """Each role publishes on every topic: acknowledged exactly where the table grants it, and what is taken
    reaches the operator (where the table lets it read), in order, up to the role's marker."""
    operator = player(shipped, OPERATOR)
    operator.subscribe("#")
    wrong: list[tuple[str, str, bool]] = []
    try:
        for user in PLAYERS:
            client = player(shipped, user)
            try:
                for topic in TOPICS:
                    taken = not client.publish(topic, user.encode()).is_failure
                    if taken != allows(TABLE, user, "publish", topic):
                        wrong.append((user, topic, taken))
                seen = [t for t in TOPICS if allows(TABLE, user, "publish", t) and allows(TABLE, OPERATOR, "read", t)]
                marker = b"marker-" + user.encode()
                assert not client.publish(seen[0], marker).is_failure
            finally:
                client.close()
            assert received_before(operator, marker) == seen, user
    finally:
        operator.close()
    assert not wrong, f"(user, topic, acknowledged) against the table: {wrong}"


def test_mosquitto_delivers_every_role_what_the_table_lets_it_read_and_nothing_else(
        shipped: ProductionBroker) -> None:
    """Every role subscribes to everything; each topic is published once, by a role the table lets write it; each
    role receives exactly the topics it may read (up to its marker, published after all of them)."""
    clients = {user: player(shipped, user) for user in PLAYERS}
    try:
        for client in clients.values():
            client.subscribe("#")
        published = []
        for topic in TOPICS:
            writer = next((user for user in PLAYERS if allows(TABLE, user, "publish", topic)), None)
            if writer is not None:  # a topic only a device of another name writes: covered by its instances
                assert not clients[writer].publish(topic, b"x").is_failure, (writer, topic)
                published.append(topic)
        for user, client in clients.items():
            marker_topic, writer = next((t, w) for t in published if allows(TABLE, user, "read", t)
                                        for w in PLAYERS if allows(TABLE, w, "publish", t))
            marker = b"marker-" + user.encode()
            assert not clients[writer].publish(marker_topic, marker).is_failure
            expected = {t for t in published if allows(TABLE, user, "read", t)}
            got = received_before(client, marker)
            assert set(got) == expected and len(got) == len(expected), \
                (user, sorted(set(got) - expected), sorted(expected - set(got)))
    finally:
        for client in clients.values():
            client.close()


# --------------------------------------------------------------------------- a sharded parameter server

SHARDS = 2
SHARD_VERSIONS = 5
"""Sync rounds both shards must make."""
TRAIN_S = 90.0


@pytest.mark.e2e
@pytest.mark.timeout(240)
async def test_a_sharded_parameter_server_trains_under_the_shipped_acl(shipped: ProductionBroker,
                                                                       tmp_path: Path) -> None:
    """``edgemesh ps --shard i/2`` as the ``ps`` user, a planner, a compressor and two devices, each with its own
    credentials: shard 0's steps reach shard 1, shard 1's norms (``clip``) reach shard 0, the workers' parts reach
    both; both shards' versions advance, and the broker refused none of their publishes."""
    job = "sharded-acl"
    settings = {"ps.shards": SHARDS, "ps.state_dir": tmp_path / "ps", "ps.aggregation": "clip", "ps.eval_every": 0,
                "training.model_spec": "digits-cnn", "training.sync_policy": "sync", "planner.min_devices": 2,
                "compressor.mode": "static", "compressor.default_codec": "none", "worker.ack_timeout_s": 5,
                "worker.codec_wait_s": 0.5}
    ps = role_config(shipped, "ps", job, **settings)
    servers = [ParameterServer(replace(ps, ps=replace(ps.ps, shard=i))) for i in range(SHARDS)]
    planner = Planner(role_config(shipped, "planner", job, **settings))
    compressor = Compressor(role_config(shipped, "compressor", job, **settings))
    workers = [Worker(role_config(shipped, device, job, **settings, **{"worker.state_dir": tmp_path / device}))
               for device in DEVICES[:2]]
    async with running(planner, compressor, *servers, *workers):
        await until("both shards' versions to advance", lambda: all(s.version >= SHARD_VERSIONS for s in servers),
                    TRAIN_S)
    assert all(w.accepted > 0 for w in workers)
    assert servers[1].metrics.value("edgemesh_ps_shard_parts_missed_total") == 0
    assert servers[0].metrics.value("edgemesh_ps_shard_norms_missing_total") == 0
    refused = {getattr(s, "device", "") or f"{s.name}{i}": s.metrics.value(f"edgemesh_{s.name}_broker_refused_total")
               for i, s in enumerate((planner, compressor, *servers, *workers))}
    assert not any(refused.values()), refused


@pytest.mark.e2e
@pytest.mark.timeout(240)
async def test_a_model_parallel_cluster_trains_under_the_shipped_acl(shipped: ProductionBroker, tmp_path: Path) -> None:
    """Two devices, each with its own credentials, in one model-parallel cluster: their readiness, the step's start,
    its batch from the member that owns it, forward and backward slices all pass the broker, and the cluster's
    steps reach the parameter server; the broker refused none of their publishes."""
    job = "mesh-acl"
    settings = {"ps.state_dir": tmp_path / "ps", "ps.eval_every": 0, "ps.broadcast": "delta",
                "training.sync_policy": "sync", "worker.ack_timeout_s": 5, "worker.codec_wait_s": 0.5,
                "worker.mesh_timeout_s": 10}
    names = list(DEVICES[:2])
    ps = ParameterServer(role_config(shipped, "ps", job, **settings))
    workers = [Worker(role_config(shipped, device, job, **settings, **{"worker.state_dir": tmp_path / device}))
               for device in names]
    planner = role_config(shipped, "planner", job, **settings)
    bus = Bus(planner.broker, client_id="planner-mesh-acl", metrics=ServiceMetrics("planner"))
    async with bus, running(ps, *workers):
        await bus.publish(Topics(job).plan(), mesh_plan(names, SPLIT, cluster="m-acl", batch=16), retain=True)
        await until("five cluster steps", lambda: ps.version >= 5 and all(w.accepted >= 5 for w in workers), TRAIN_S)
    assert all(w.metrics.value("edgemesh_worker_mesh_steps_total", outcome="done") >= 5 for w in workers)
    refused = {w.device: w.metrics.value("edgemesh_worker_broker_refused_total") for w in workers}
    refused["ps"] = ps.metrics.value("edgemesh_ps_broker_refused_total")
    assert not any(refused.values()), refused
