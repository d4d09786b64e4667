"""Who may publish and read what on the broker, role by role: the table, and the Mosquitto ACL made from it.

Every grant is a topic or filter of ``topics`` (:class:`~edgemesh.common.topics.EveryJob`: the topics of every
job), so the ACL follows the topic layout. ``python -m edgemesh.common.acl > deploy/mosquitto/acl`` writes the
shipped file (``--markdown``: the table of docs/deployment.md); tests/test_acl.py checks that the shipped file is
this one and that Mosquitto enforces it on every role, both ways (:func:`allows` says what it should).

The roles are broker user names:

* **a device** logs in as its device name (``worker.device``). Its grants are Mosquitto ``pattern`` lines, where
  ``%u`` stands for the user name, so a device writes only topics that name it. Pattern lines apply to every user,
  the services', the operator's and the bridges' too: for them they name a device called like them, which no
  device may be (and a bridge user may read the cloud broker's own jobs as a device would);
* **planner**, **ps** (every parameter server, and every shard of a sharded one: one user), **compressor** and
  **operator** have ``user`` blocks. On a cloud broker the same grants hold under every bridged site's prefix
  (``sites/+/``), for the cloud-side services of a site's jobs (``broker.topic_prefix``);
* **bridge-{site}**, on a cloud broker only: a site's bridge (deploy/mosquitto/bridge.conf), which carries that
  site's topics under its prefix, ``sites/{site}/``, and may read and write nothing else.

What the broker cannot tell apart: it knows a client by its user name alone (``%u``; a client id is not an
identity), not by the cluster a plan puts a device in. So the forward slices and step messages of every
model-parallel cluster (``mesh/{cluster}/{layer}/fwd/{sender}``, ``mesh/{cluster}/step/...``), which a member
sends every other member of its cluster without naming them, are readable by every device; a backward slice
names its receiver and only the receiver reads it. Likewise a device may send gradients naming any cluster
(the parameter server checks a device's cluster against the plan), and every service and device writes the one
``events`` topic of a job, which names no sender.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from edgemesh.common.topics import (
    ANY,
    PREFIX,
    SERVICE_TARGETS,
    EveryJob,
    Filter,
    all_job_states_filter,
    all_jobs_filter,
    matches,
    site_prefix,
)

Access = Literal["publish", "read"]
USER = "%u"
"""Mosquitto's stand-in for the user name, in a pattern line: a device's own name."""
SITES = ("site1", "site2")
"""The bridged sites the shipped ACL names (``--site``): two, so that one cannot reach the other's."""
SERVICES = ("planner", "ps", "compressor")
"""The services' user names (a device may not be called so)."""
OPERATOR = "operator"
MOSQUITTO_ACCESS: dict[Access, str] = {"publish": "write", "read": "read"}
COMMENT_WIDTH = 100
"""Comment lines of the ACL file are wrapped at this width."""


def bridge_user(site: str) -> str:
    """The cloud broker's user for ``site``'s bridge (bridge.conf's ``remote_username``)."""
    return f"bridge-{site}"


def bridge_client_id(site: str) -> str:
    """``site``'s bridge's client id on the cloud broker (bridge.conf's ``remote_clientid``)."""
    return f"edgemesh-bridge-{site}"


def bridge_state_topic(site: str) -> str:
    """Where Mosquitto's bridge of ``site`` says it is up (1) or down (0), retained (``notifications true``)."""
    return f"$SYS/broker/connection/{bridge_client_id(site)}/state"


@dataclass(frozen=True, slots=True)
class Grant:
    """A topic or filter a role may publish on or read, and why (the comment above it in the ACL file)."""

    access: Access
    topic: str
    retained: bool = False
    """Retained: also its chunks (``{topic}/chunk/+``), where a retained message larger than
    ``broker.chunk_bytes`` travels (``Filter.patterns``)."""
    why: str = ""

    @property
    def filters(self) -> tuple[str, ...]:
        return Filter(self.topic, "job").patterns if self.retained else (self.topic,)  # any kind: its patterns


def publish(topic: str, *, retained: bool = False) -> Grant:
    return Grant("publish", topic, retained)


def read(filter_: Filter | str, *, retained: bool = False) -> Grant:
    return Grant("read", filter_ if isinstance(filter_, str) else filter_.pattern, retained)


def because(why: str, *grants: Grant) -> tuple[Grant, ...]:
    """``grants``, for the reason ``why``."""
    return tuple(replace(grant, why=why) for grant in grants)


@dataclass(frozen=True, slots=True)
class Role:
    """A broker user (or, ``device``, every user by its own name) and what it may publish and read."""

    user: str
    summary: str
    grants: tuple[Grant, ...]
    device: bool = False
    """Mosquitto pattern lines (``%u`` the user's name), which every user has."""
    sites: bool = False
    """Also under every bridged site's prefix, ``sites/+/`` (on a cloud broker)."""

    def filters(self, access: Access) -> Iterator[str]:
        """Every filter this role may ``access``, site prefixes and chunks included."""
        for grant in self.grants:
            if grant.access == access:
                yield from grant.filters
                if self.sites:
                    yield from (site_prefix(ANY) + f for f in grant.filters)


def _serving() -> tuple[Grant, ...]:
    """What every service process and device host reads to know which job runs (``services/host.py``)."""
    return because("the submitted jobs and their states (retained), of every job: which job runs now",
                   read(all_jobs_filter(), retained=True), read(all_job_states_filter(), retained=True))


def _controlled(t: EveryJob, target: str, *, reply: str) -> tuple[Grant, ...]:
    """The control protocol's side of a role: ``control/{target}`` and ``control/all`` in, answers on ``reply``,
    and its audit trail (``services/runtime.py``)."""
    return (*because("control commands for it and for everyone, its answers to them",
                     read(t.control_filter(target)), read(t.control_filter("all")), publish(reply)),
            *because("its audit events", publish(t.events())))


def device(t: EveryJob, shards: EveryJob) -> Role:
    me = USER
    return Role("device", "every worker, logged in as its device name (%u)", device=True, grants=(
        *because("its hello and status, retained (the status is also its will, and its host's 'left')",
                 publish(t.hello(me), retained=True), publish(t.status(me), retained=True)),
        *because("its stats, link probes (timed to the PUBACK, read by nobody) and local evaluations",
                 publish(t.stats(me)), publish(t.probe(me)), publish(t.evaluation(me))),
        *because("its request for the whole model", publish(t.snapshot_request(me))),
        *because("its gradient updates: to the parameter server, raw to the compressor's gateway, to each shard "
                 "of a sharded parameter server",
                 publish(t.grad(ANY, me)), publish(t.grad_raw(ANY, me)), publish(shards.grad(ANY, me))),
        *because("model-parallel clusters: what it sends its cluster (the last level names the sender), its own "
                 "data's batch included when it owns a step",
                 publish(t.mesh(ANY, ANY, "fwd", me)), publish(t.mesh(ANY, ANY, "input", me)),
                 publish(t.mesh(ANY, "step", "begin", me)),
                 publish(t.mesh(ANY, "step", "ready", me), retained=True),
                 publish(t.mesh_backward(ANY, ANY, ANY, me))),
        *because("model-parallel clusters: forward slices, a step's batch and step messages go to a cluster's "
                 "members, whom the topic does not name (every cluster's are readable); backward slices name their "
                 "receiver",
                 read(t.mesh_filter(ANY, ANY, "fwd", ANY)), read(t.mesh_filter(ANY, ANY, "input", ANY)),
                 read(t.mesh_filter(ANY, "step", "begin", ANY)),
                 read(t.mesh_filter(ANY, "step", "ready", ANY), retained=True), read(t.backward_filter(ANY, me))),
        *because("the plan and its own codec policy (retained)",
                 read(t.plan_filter(), retained=True), read(t.codec_filter(me), retained=True)),
        *because("the model: snapshots (retained), deltas, a model-parallel member's part of each delta; each "
                 "shard's of a sharded parameter server",
                 read(t.model_filter(), retained=True), read(t.delta_filter()), read(t.delta_filter(me)),
                 read(shards.model_filter(), retained=True), read(shards.delta_filter()),
                 read(shards.delta_filter(me))),
        *because("the answers to its own updates (each shard's)",
                 read(t.ack_filter(me)), read(shards.ack_filter(me))),
        *_serving(),
        *_controlled(t, f"device/{me}", reply=t.device_reply(t.control_reply(ANY), me)),
    ))


def planner(t: EveryJob) -> Role:
    return Role("planner", "the planner", sites=True, grants=(
        *because("the plan (retained), and the one it adopts when it starts",
                 publish(t.plan(), retained=True), read(t.plan_filter(), retained=True)),
        *because("the device registry: hellos and statuses (retained), stats",
                 read(t.hello_filter(), retained=True), read(t.status_filter(), retained=True),
                 read(t.stats_filter())),
        *because("the parameter server's sync state (retained): adaptive batch sizes",
                 read(t.sync_filter(), retained=True)),
        *_serving(),
        *_controlled(t, "planner", reply=t.control_reply(ANY)),
    ))


def parameter_server(t: EveryJob, shards: EveryJob) -> Role:
    return Role("ps", "every parameter server, and every shard of a sharded one", sites=True, grants=(
        *because("the plan (retained), the updates (a shard's: its rows), local evaluations and devices' "
                 "requests for the whole model",
                 read(t.plan_filter(), retained=True), read(t.grad_filter()), read(shards.grad_filter()),
                 read(t.evaluation_filter()), read(t.snapshot_request_filter())),
        *because("its model: snapshots (retained), deltas and a model-parallel member's part of each; acks; its "
                 "sync state (retained)",
                 publish(t.model(), retained=True), publish(t.model_delta()), publish(t.model_delta_for(ANY)),
                 publish(t.ack(ANY)), publish(t.sync(), retained=True)),
        *because("a sharded parameter server: each shard's model and acks, as above",
                 publish(shards.model(), retained=True), publish(shards.model_delta()),
                 publish(shards.model_delta_for(ANY)), publish(shards.ack(ANY))),
        *because("shard 0's steps (retained), which the other shards take",
                 publish(t.steps(), retained=True), read(t.steps_filter(), retained=True)),
        *because("the other shards' parts of updates' norms and distances, which shard 0 takes (clip, krum)",
                 publish(shards.norms()), read(t.norms_filter())),
        *because("every shard's model, which shard 0 puts together to evaluate",
                 read(shards.model_filter(), retained=True), read(shards.delta_filter())),
        *because("the job board (shard 0's host): every job's state and final model (retained), the operators' "
                 "job commands, devices' statuses (a device that left), the evaluation events",
                 publish(t.job_state(), retained=True), publish(t.job_model(), retained=True),
                 read(t.control_filter("job")), read(t.status_filter(), retained=True), read(t.events_filter())),
        *_serving(),
        *_controlled(t, "ps", reply=t.control_reply(ANY)),
    ))


def compressor(t: EveryJob) -> Role:
    return Role("compressor", "the compressor, and its gateway", sites=True, grants=(
        *because("codec policies (retained), and the ones it takes back when it starts",
                 publish(t.codec(ANY), retained=True), read(t.codec_filter(), retained=True)),
        *because("devices' hellos (retained) and stats", read(t.hello_filter(), retained=True),
                 read(t.stats_filter())),
        *because("the gateway: raw updates of devices that cannot encode in, encoded ones out, as theirs",
                 read(t.grad_raw_filter()), publish(t.grad(ANY, ANY))),
        *_serving(),
        *_controlled(t, "compressor", reply=t.control_reply(ANY)),
    ))


def operator(t: EveryJob) -> Role:
    return Role(OPERATOR, "people and tools: edgemesh job, ctl and devices, mosquitto_pub", sites=True, grants=(
        *because("control commands: the operator alone steers services, devices and jobs",
                 *(publish(t.control(target)) for target in (*SERVICE_TARGETS, f"device/{ANY}"))),
        *because("edgemesh job submit: the job file (retained)", publish(t.job_file(), retained=True)),
        *because("everything of every job: devices, plan, codecs, model, jobs, events, the answers to it",
                 read(f"{t.root}/#")),
    ))


def bridge(site: str) -> Role:
    own = f"{site_prefix(site)}{PREFIX}/#"
    return Role(bridge_user(site), f"{site}'s bridge, on a cloud broker", grants=(
        *because("its site's topics, under its prefix, both ways", publish(own), read(own)),
        *because("its up/down notification (bridge.conf: notifications true, remote_clientid)",
                 publish(bridge_state_topic(site))),
    ))


def roles(sites: Sequence[str] = SITES) -> tuple[Role, ...]:
    """Every role: devices, the services, the operator and the bridges of ``sites``."""
    t, shards = EveryJob(), EveryJob(every_shard=True)
    return (device(t, shards), planner(t), parameter_server(t, shards), compressor(t), operator(t),
            *(bridge(site) for site in sites))


def allows(table: Sequence[Role], user: str, access: Access, topic: str) -> bool:
    """Whether the ACL of ``table`` lets ``user`` ``access`` ``topic`` as Mosquitto reads it: the grants of the
    user's own block, and the device's pattern lines with its name for ``%u``."""
    return any(matches(filter_.replace(USER, user), topic)
               for role in table if role.device or role.user == user for filter_ in role.filters(access))


# --------------------------------------------------------------------------- the ACL file

HEADER = """\
# EdgeMesh broker ACL (Mosquitto acl_file), installed as /etc/mosquitto/edgemesh.acl.
# Generated by `python -m edgemesh.common.acl > deploy/mosquitto/acl` from the table in
# edgemesh/common/acl.py, which builds every topic with edgemesh/common/topics.py: change the
# table, not this file (tests/test_acl.py checks they agree). docs/deployment.md has the table.
#
# Roles are MQTT user names (password_file):
#   <device name>             each worker logs in as its own device name (worker.device, the
#                             edgemesh-worker@DEVICE instance): the pattern lines, %u its name
#   planner, ps, compressor   the services, one user each (ps: every parameter server and shard)
#   operator                  people and tools: edgemesh job, ctl, devices; mosquitto_pub
#   bridge-<site>             only on a cloud broker that site bridges connect to
#
# Mosquitto denies everything not granted here. Only the operator writes control/#. Retained
# messages larger than broker.chunk_bytes are published as <topic>/chunk/<n>: every retained
# topic is granted with its chunks. On a cloud broker a bridged site's topics are under
# sites/<site>/ (bridge.conf); the services and the operator hold their grants there too."""


def render(table: Sequence[Role]) -> str:
    """The Mosquitto ACL file of ``table``."""
    lines = [HEADER]
    for role in table:
        title = f"# --- {role.user}: {role.summary} "
        lines += ["", title + "-" * max(0, COMMENT_WIDTH - len(title))]
        if role.device:
            lines.append("# pattern lines apply to every user, services included (a service's name is no device's)")
        else:
            lines.append(f"user {role.user}")
        keyword = "pattern" if role.device else "topic"
        lines += _lines(keyword, role.grants, "")
        if role.sites:
            lines.append(f"# the same, for every bridged site's jobs on a cloud broker ({site_prefix(ANY)}...)")
            lines += _lines(keyword, role.grants, site_prefix(ANY), comments=False)
    return "\n".join(lines) + "\n"


def _lines(keyword: str, grants: Sequence[Grant], prefix: str, *, comments: bool = True) -> list[str]:
    lines, why = [], ""
    for grant in grants:
        if comments and grant.why != why:
            lines += textwrap.wrap(grant.why, COMMENT_WIDTH, initial_indent="# ", subsequent_indent="# ")
            why = grant.why
        lines += [f"{keyword} {MOSQUITTO_ACCESS[grant.access]} {prefix}{f}" for f in grant.filters]
    return lines


def markdown(table: Sequence[Role]) -> str:
    """The table of docs/deployment.md: per role, what it publishes and reads, below ``edgemesh/v1/{job}/``."""
    rows = ["| role (user) | publishes | reads |", "|---|---|---|"]
    for role in table:
        cells = [", ".join(_relative(g) for g in role.grants if g.access == access)
                 for access in ("publish", "read")]
        name = "a device (its device name)" if role.device else f"`{role.user}`"
        rows.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return "\n".join(rows) + "\n"


def _relative(grant: Grant) -> str:
    """``grant``'s topic below the job's root, ``{self}`` for the device's own name, ``*``: with chunks."""
    topic = grant.topic.removeprefix(f"{EveryJob().root}/").replace(USER, "{self}")
    return f"`{topic}`" + ("\\*" if grant.retained else "")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m edgemesh.common.acl",
                                     description="Print the broker ACL (deploy/mosquitto/acl) made from the roles' "
                                                 "table, or (--markdown) the table of docs/deployment.md.")
    parser.add_argument("--site", action="append", metavar="NAME",
                        help=f"a bridged site, whose bridge-NAME user the ACL names (repeat; default: "
                             f"{', '.join(SITES)})")
    parser.add_argument("--markdown", action="store_true", help="the table of docs/deployment.md instead")
    args = parser.parse_args(argv)
    table = roles(tuple(args.site) if args.site else SITES)
    sys.stdout.write(markdown(table) if args.markdown else render(table))


if __name__ == "__main__":
    main()
