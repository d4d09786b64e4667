"""Every MQTT topic and subscription filter EdgeMesh uses, built and parsed in one place (docs/topics.md).

All topics live under ``edgemesh/v1/{job}/`` so several trainings can share one broker.

* ``Topics(job)`` builds the topics a service publishes on (``topics.grad(cluster, device)``)
  and the :class:`Filter` objects it subscribes with (``topics.grad_filter()``).
* :func:`parse` reads a topic into a :class:`TopicMatch` (job, kind, device, cluster, ...): each family
  of topics has its parser, found by the topic's first level after the job; :func:`parse_as` goes
  straight to the parser of a family already known (the kind of the filter the topic fell under).
  :func:`match` finds the filter a received topic falls under and parses the topic by that filter's
  kind, for the bus's router; :meth:`TopicMatch.disagreement` checks a decoded body against it (the
  device a topic names is the device in the body).

A sharded parameter server (``ps.shards`` > 1) owns its gradients, acks and model broadcast under
``shard/{index}/`` (``Topics(job, shard=i)``); shard 0 also publishes the steps the others follow on
``shard/0/steps``, and under ``clip`` the others tell it their part of updates' norms on ``shard/{i}/norms``;
every other topic is the job's own.

Large retained messages are chunked onto ``{topic}/chunk/{index}`` (see ``wire``); a filter
subscribes to both the topic and its chunks (``Filter.patterns``).

A device answers a control command on its reply topic with its own name as the last level
(``control-reply/{requester}/{device}``, :meth:`Topics.device_reply`), as it sends mesh slices: the broker's ACL
lets it answer only as itself. On a cloud broker, a bridged site's topics are under :func:`site_prefix`
(``sites/{site}/edgemesh/v1/...``, deploy/mosquitto/bridge.conf). :class:`EveryJob` builds the topics of every job
as filters, for the broker's ACL (``edgemesh.common.acl``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from edgemesh.common.vocabulary import MAX_TOPIC_CHARS, check_name, valid_name, valid_topic

__all__ = ["MAX_TOPIC_CHARS", "CHUNK_SEGMENT", "PREFIX", "SITES_SEGMENT", "EveryJob", "Filter", "TopicError",
           "TopicMatch", "Topics", "all_job_states_filter", "all_jobs_filter", "base_topic", "check_name", "match",
           "matches", "parse", "parse_as", "site_prefix", "valid_name", "valid_topic"]

PREFIX = "edgemesh/v1"
CHUNK_SEGMENT = "chunk"
SITES_SEGMENT = "sites"
"""The first level of a bridged site's topics on a cloud broker (:func:`site_prefix`)."""
ANY = "+"
"""A level of any name, in a filter."""

TopicKind = Literal["hello", "status", "stats", "evaluation", "snapshot_request", "probe", "plan", "sync", "codec",
                    "model", "delta", "grad", "grad_raw", "ack", "mesh", "control", "reply", "events", "job",
                    "job_state", "job_model", "steps", "norms"]
"""The families of topics; a route is named after the family it consumes."""
MAX_SHARDS = 64
"""Most parameter server shards a topic may name."""
SHARD_KINDS = ("model", "delta", "grad", "ack", "steps", "norms")
"""The families a parameter server shard has under ``shard/{index}/``."""
SHARD_ONLY_KINDS = ("steps", "norms")
"""The families only under ``shard/{index}/`` (nothing outside ``shard/`` is named so)."""
SERVICE_TARGETS = ("planner", "ps", "compressor", "all", "job")
"""Control targets other than ``device/{id}``."""
CHECKED_FIELDS = ("device", "cluster", "layer", "phase")
"""Fields a topic names that a message body must not contradict."""


class TopicError(ValueError):
    """A topic that is not one of EdgeMesh's."""


@dataclass(frozen=True, slots=True)
class TopicMatch:
    """A received topic, parsed: its family and the names it carries (empty where it has none)."""

    job: str
    kind: TopicKind
    topic: str = ""
    """The topic itself (without a chunk suffix)."""
    device: str = ""
    """The device the topic is about: the sender of a hello, stats or gradient, the owner of a codec
    policy or ack, the member sending a mesh slice or step message, the target of ``control/device/{id}``."""
    cluster: str = ""
    layer: str = ""
    phase: str = ""
    target: str = ""
    """``control/{target}``: planner, ps, compressor, all or device/{id}; ``control-reply/{requester}``:
    the requester; a mesh backward slice: its receiver."""
    shard: int = -1
    """The parameter server shard a ``shard/{index}/...`` topic belongs to (-1: not a shard's topic)."""

    def disagreement(self, body: object) -> str | None:
        """Why ``body`` contradicts this topic (a field the topic names holds another value), or None."""
        for name in CHECKED_FIELDS:
            named = getattr(self, name)
            value = getattr(body, name, None)
            if named and isinstance(value, str) and value and value != named:
                return f"{name} {value!r} on a topic of {name} {named!r}"
        if self.kind == "reply" and self.device and getattr(body, "source", None) != f"device/{self.device}":
            return f"source {getattr(body, 'source', None)!r} on device {self.device!r}'s reply topic"
        return None


@dataclass(frozen=True, slots=True)
class Filter:
    """A subscription filter and the family of topics it matches."""

    pattern: str
    kind: TopicKind

    @property
    def patterns(self) -> tuple[str, ...]:
        """What to subscribe to: the filter and, unless it ends in ``#``, its retained chunks."""
        if self.pattern.endswith("#"):
            return (self.pattern,)
        return (self.pattern, f"{self.pattern}/{CHUNK_SEGMENT}/+")

    def matches(self, topic: str) -> bool:
        """Whether ``topic`` (without a chunk suffix) falls under this filter."""
        return matches(self.pattern, topic)


@dataclass(frozen=True, slots=True)
class Topics:
    """Topic and filter builder for one job; with ``shard``, the gradient, ack and model topics are that
    parameter server shard's."""

    job: str
    shard: int | None = None

    def __post_init__(self) -> None:
        check_name("job", self.job)
        if self.shard is not None and not 0 <= self.shard < MAX_SHARDS:
            raise TopicError(f"shard {self.shard} is not in [0, {MAX_SHARDS})")

    @property
    def root(self) -> str:
        return f"{PREFIX}/{self.job}"

    @property
    def ps_root(self) -> str:
        """Where the parameter server (this shard of it) has its gradients, acks and model."""
        return self.root if self.shard is None else f"{self.root}/shard/{self.shard}"

    def for_shard(self, shard: int | None) -> Topics:
        """The same job's topics, with ``shard``'s gradient, ack and model topics."""
        return Topics(self.job, shard)

    def _filter(self, relative: str, kind: TopicKind) -> Filter:
        return Filter(f"{self.root}/{relative}", kind)

    def _ps_filter(self, relative: str, kind: TopicKind) -> Filter:
        return Filter(f"{self.ps_root}/{relative}", kind)

    # --- devices -----------------------------------------------------------------------
    def hello(self, device: str) -> str:
        return f"{self.root}/device/{device}/hello"

    def status(self, device: str) -> str:
        return f"{self.root}/device/{device}/status"

    def stats(self, device: str) -> str:
        return f"{self.root}/device/{device}/stats"

    def evaluation(self, device: str) -> str:
        """A device's accuracy on its local validation share (jobs evaluated where the data lives)."""
        return f"{self.root}/device/{device}/evaluation"

    def snapshot_request(self, device: str) -> str:
        """Where a device asks the parameter server for the whole model (its own topic: a broker ACL lets
        devices write there, and not on the operator's control topics)."""
        return f"{self.root}/device/{device}/snapshot-request"

    def probe(self, device: str) -> str:
        """Where a device times its round trip to the broker (publish to PUBACK; nobody subscribes): its own
        topic, which a broker ACL lets it write."""
        return f"{self.root}/device/{device}/probe"

    def snapshot_request_filter(self) -> Filter:
        return self._filter("device/+/snapshot-request", "snapshot_request")

    def evaluation_filter(self) -> Filter:
        return self._filter("device/+/evaluation", "evaluation")

    def hello_filter(self) -> Filter:
        return self._filter("device/+/hello", "hello")

    def status_filter(self) -> Filter:
        return self._filter("device/+/status", "status")

    def stats_filter(self) -> Filter:
        return self._filter("device/+/stats", "stats")

    # --- plan, codec, model, sync -------------------------------------------------------
    def plan(self) -> str:
        return f"{self.root}/plan"

    def plan_filter(self) -> Filter:
        return self._filter("plan", "plan")

    def codec(self, device: str) -> str:
        return f"{self.root}/codec/{device}"

    def codec_filter(self, device: str = "+") -> Filter:
        return self._filter(f"codec/{device}", "codec")

    def model(self) -> str:
        return f"{self.ps_root}/model"

    def model_filter(self) -> Filter:
        return self._ps_filter("model", "model")

    def model_delta(self) -> str:
        return f"{self.ps_root}/model/delta"

    def model_delta_for(self, device: str) -> str:
        """A model-parallel member's part of every delta: the blocks of the rows it trains."""
        return f"{self.ps_root}/model/delta/{device}"

    def delta_filter(self, device: str = "") -> Filter:
        """The broadcast deltas, or (with ``device``) that member's part of each."""
        return self._ps_filter(f"model/delta/{device}" if device else "model/delta", "delta")

    def steps(self) -> str:
        """Shard 0's retained ``ShardSteps``: the steps every other shard of the parameter server applies."""
        return f"{self.for_shard(0).ps_root}/steps"

    def steps_filter(self) -> Filter:
        return Filter(self.steps(), "steps")

    def norms(self) -> str:
        """This shard's part of updates' norms (``ShardNorms``), for shard 0's ``clip``."""
        return f"{self.ps_root}/norms"

    def norms_filter(self) -> Filter:
        """Every shard's norms."""
        return Filter(f"{self.root}/shard/+/norms", "norms")

    def sync(self) -> str:
        """The parameter server's retained ``SyncState`` (policy, bound, deadline, delay indices)."""
        return f"{self.root}/sync"

    def sync_filter(self) -> Filter:
        return self._filter("sync", "sync")

    # --- gradients and acks ----------------------------------------------------------------
    def grad(self, cluster: str, device: str) -> str:
        return f"{self.ps_root}/grad/{cluster}/{device}"

    def grad_filter(self) -> Filter:
        return self._ps_filter("grad/+/+", "grad")

    def grad_raw(self, cluster: str, device: str) -> str:
        return f"{self.root}/grad-raw/{cluster}/{device}"

    def grad_raw_filter(self) -> Filter:
        return self._filter("grad-raw/+/+", "grad_raw")

    def ack(self, device: str) -> str:
        return f"{self.ps_root}/ack/{device}"

    def ack_filter(self, device: str) -> Filter:
        return self._ps_filter(f"ack/{device}", "ack")

    # --- model-parallel mesh ---------------------------------------------------------------
    def mesh(self, cluster: str, layer: str, phase: str, device: str) -> str:
        """What member ``device`` sends its cluster: a forward slice of ``layer``, or (layer ``step``) a step's
        begin or ready. The last level is the sender, so a broker ACL lets a device send only as itself."""
        return f"{self.root}/mesh/{cluster}/{layer}/{phase}/{device}"

    def mesh_filter(self, cluster: str, layer: str, phase: str, device: str) -> Filter:
        return self._filter(f"mesh/{cluster}/{layer}/{phase}/{device}", "mesh")

    def mesh_backward(self, cluster: str, layer: str, receiver: str, sender: str) -> str:
        """A backward slice of ``layer`` from ``sender`` to ``receiver`` alone (the sender last, as above)."""
        return f"{self.root}/mesh/{cluster}/{layer}/bwd/{receiver}/{sender}"

    def backward_filter(self, cluster: str, receiver: str) -> Filter:
        """Every backward slice sent to ``receiver`` in ``cluster``."""
        return self._filter(f"mesh/{cluster}/+/bwd/{receiver}/+", "mesh")

    def cluster_mesh_filter(self, cluster: str) -> Filter:
        """Every mesh message of ``cluster`` (recorders and tests)."""
        return self._filter(f"mesh/{cluster}/#", "mesh")

    # --- operations ------------------------------------------------------------------------
    def control(self, target: str) -> str:
        """``target`` is planner | ps | compressor | all | device/{id}."""
        return f"{self.root}/control/{target}"

    def control_filter(self, target: str) -> Filter:
        return self._filter(f"control/{target}", "control")

    def control_reply(self, requester: str) -> str:
        return f"{self.root}/control-reply/{requester}"

    @staticmethod
    def device_reply(reply_topic: str, device: str) -> str:
        """Where ``device`` answers a command whose answer goes to ``reply_topic``: that topic, then the device
        (the last level names the sender: a broker ACL lets a device answer only as itself)."""
        return f"{reply_topic}/{device}"

    def reply_filter(self, requester: str) -> Filter:
        """The answers to ``requester``: the services' (``control-reply/{requester}``) and the devices'
        (``control-reply/{requester}/{device}``)."""
        return self._filter(f"control-reply/{requester}/#", "reply")

    def events(self) -> str:
        return f"{self.root}/events"

    def events_filter(self) -> Filter:
        return self._filter("events", "events")

    # --- jobs -------------------------------------------------------------------------------
    def job_file(self) -> str:
        """The submitted job file (retained): what every service serves while the job runs."""
        return f"{self.root}/job"

    def job_state(self) -> str:
        """The job's state and progress (retained), published by the parameter server's host."""
        return f"{self.root}/job/state"

    def job_model(self) -> str:
        """The job's final model (retained, float32), for ``edgemesh job export``."""
        return f"{self.root}/job/model"

    def job_state_filter(self) -> Filter:
        return self._filter("job/state", "job_state")

    def job_model_filter(self) -> Filter:
        return self._filter("job/model", "job_model")

    # --- chunking --------------------------------------------------------------------------
    @staticmethod
    def chunk(topic: str, index: int) -> str:
        return f"{topic}/{CHUNK_SEGMENT}/{index}"


@dataclass(frozen=True, slots=True)
class EveryJob(Topics):
    """The topics of every job, as filters: the job level is ``+`` (a broker's ACL, ``edgemesh.common.acl``).
    With ``every_shard``, the gradient, ack and model topics are those of every parameter server shard
    (``shard/+/``); a topic only one shard has (``steps``: shard 0's) keeps its index."""

    job: str = ANY
    every_shard: bool = False

    def __post_init__(self) -> None:
        """The job level is a wildcard, not a name; no shard index is checked: none is given."""

    @property
    def root(self) -> str:
        return f"{PREFIX}/{ANY}"

    @property
    def ps_root(self) -> str:
        if self.every_shard:
            return f"{self.root}/shard/{ANY}"
        return self.root if self.shard is None else f"{self.root}/shard/{self.shard}"

    def for_shard(self, shard: int | None) -> Topics:
        return EveryJob(shard=shard)


def site_prefix(site: str) -> str:
    """What comes before a bridged site's topics on a cloud broker (``sites/{site}/``): the remote prefix of
    the site's bridge (deploy/mosquitto/bridge.conf), and the ``broker.topic_prefix`` of the cloud-side services
    and operators of that site's jobs. ``site`` may be ``+``: every site's, in a filter."""
    if site != ANY:
        check_name("site", site)
    return f"{SITES_SEGMENT}/{site}/"


def all_jobs_filter() -> Filter:
    """Every job submitted on the broker (the services that serve submitted jobs consume it)."""
    return Filter(f"{PREFIX}/+/job", "job")


def all_job_states_filter() -> Filter:
    """Every job's state (``edgemesh job list``, and the services: which job runs now)."""
    return Filter(f"{PREFIX}/+/job/state", "job_state")


# --- parsing: one parser per family --------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Levels:
    """A received topic split for its parsers: its job, its levels after the job (and after ``shard/{index}``), the
    topic without a chunk suffix, and its shard (-1: not a shard's topic)."""

    job: str
    rest: list[str]
    base: str
    shard: int = -1

    @classmethod
    def of(cls, topic: str) -> _Levels:
        """``topic`` split, a trailing ``chunk/{i}`` dropped; TopicError when it is not under ``edgemesh/v1/{job}/``."""
        parts = topic.split("/")
        if _has_chunk_suffix(parts):
            parts = parts[:-2]
        if len(parts) < 4 or f"{parts[0]}/{parts[1]}" != PREFIX or not valid_name(parts[2]):
            raise TopicError(f"{topic!r} is not under {PREFIX}/{{job}}/")
        job, rest, base = parts[2], parts[3:], "/".join(parts)
        match rest:
            case ["shard", index, _, *_] if index.isascii() and index.isdigit() and int(index) < MAX_SHARDS:
                return cls(job, rest[2:], base, int(index))
        return cls(job, rest, base)

    def as_kind(self, kind: TopicKind) -> TopicMatch | None:
        """These levels parsed as a topic of ``kind``; None when they are not one (under ``shard/{index}/``, only
        the families a shard has)."""
        if kind not in SHARD_KINDS if self.shard >= 0 else kind in SHARD_ONLY_KINDS:
            return None
        return _FAMILIES[kind][1](self)


Parser = Callable[[_Levels], TopicMatch | None]
"""One family's parser: the topic as a ``TopicMatch`` of that family, or None when its levels are another's."""


def _fixed(kind: TopicKind, *levels: str) -> Parser:
    """A family of one topic per job (``plan``, ``job/state``)."""
    expected = list(levels)

    def parse(where: _Levels) -> TopicMatch | None:
        return TopicMatch(where.job, kind, where.base, shard=where.shard) if where.rest == expected else None
    return parse


def _of_device(kind: TopicKind, level: str) -> Parser:
    """``device/{device}/{level}``: what a device says of itself."""
    def parse(where: _Levels) -> TopicMatch | None:
        match where.rest:
            case ["device", device, last] if last == level:
                return TopicMatch(where.job, kind, where.base, device=device)
        return None
    return parse


def _for_device(kind: TopicKind, level: str) -> Parser:
    """``{level}/{device}``: a device's codec policy or ack."""
    def parse(where: _Levels) -> TopicMatch | None:
        match where.rest:
            case [first, device] if first == level:
                return TopicMatch(where.job, kind, where.base, device=device, shard=where.shard)
        return None
    return parse


def _from_member(kind: TopicKind, level: str) -> Parser:
    """``{level}/{cluster}/{device}``: a gradient and its sender."""
    def parse(where: _Levels) -> TopicMatch | None:
        match where.rest:
            case [first, cluster, device] if first == level:
                return TopicMatch(where.job, kind, where.base, device=device, cluster=cluster, shard=where.shard)
        return None
    return parse


def _delta(where: _Levels) -> TopicMatch | None:
    """``model/delta``, or a model-parallel member's part of it, ``model/delta/{device}``."""
    match where.rest:
        case ["model", "delta"]:
            return TopicMatch(where.job, "delta", where.base, shard=where.shard)
        case ["model", "delta", device]:
            return TopicMatch(where.job, "delta", where.base, device=device, shard=where.shard)
    return None


def _mesh(where: _Levels) -> TopicMatch | None:
    """A forward slice or step message from its sender, or a backward slice from its sender to its receiver."""
    match where.rest:
        case ["mesh", cluster, layer, phase, device] if phase != "bwd":
            return TopicMatch(where.job, "mesh", where.base, device=device, cluster=cluster, layer=layer, phase=phase)
        case ["mesh", cluster, layer, "bwd", receiver, sender]:
            return TopicMatch(where.job, "mesh", where.base, device=sender, cluster=cluster, layer=layer, phase="bwd",
                              target=receiver)
    return None


def _control(where: _Levels) -> TopicMatch | None:
    """``control/{service target}`` or ``control/device/{device}``."""
    match where.rest:
        case ["control", target] if target in SERVICE_TARGETS:
            return TopicMatch(where.job, "control", where.base, target=target)
        case ["control", "device", device]:
            return TopicMatch(where.job, "control", where.base, device=device, target=f"device/{device}")
    return None


def _reply(where: _Levels) -> TopicMatch | None:
    """A service's answer to ``requester``, or a device's (its name last)."""
    match where.rest:
        case ["control-reply", requester]:
            return TopicMatch(where.job, "reply", where.base, target=requester)
        case ["control-reply", requester, device]:
            return TopicMatch(where.job, "reply", where.base, device=device, target=requester)
    return None


_FAMILIES: dict[TopicKind, tuple[str, Parser]] = {
    "hello": ("device", _of_device("hello", "hello")),
    "status": ("device", _of_device("status", "status")),
    "stats": ("device", _of_device("stats", "stats")),
    "evaluation": ("device", _of_device("evaluation", "evaluation")),
    "snapshot_request": ("device", _of_device("snapshot_request", "snapshot-request")),
    "probe": ("device", _of_device("probe", "probe")),
    "plan": ("plan", _fixed("plan", "plan")),
    "sync": ("sync", _fixed("sync", "sync")),
    "model": ("model", _fixed("model", "model")),
    "delta": ("model", _delta),
    "events": ("events", _fixed("events", "events")),
    "job": ("job", _fixed("job", "job")),
    "job_state": ("job", _fixed("job_state", "job", "state")),
    "job_model": ("job", _fixed("job_model", "job", "model")),
    "codec": ("codec", _for_device("codec", "codec")),
    "ack": ("ack", _for_device("ack", "ack")),
    "grad": ("grad", _from_member("grad", "grad")),
    "grad_raw": ("grad-raw", _from_member("grad_raw", "grad-raw")),
    "mesh": ("mesh", _mesh),
    "control": ("control", _control),
    "reply": ("control-reply", _reply),
    "steps": ("steps", _fixed("steps", "steps")),
    "norms": ("norms", _fixed("norms", "norms")),
}
"""Each family: the first level of its topics after the job, and its parser."""


def _kinds_at() -> dict[str, tuple[TopicKind, ...]]:
    kinds: dict[str, tuple[TopicKind, ...]] = {}
    for kind, (level, _) in _FAMILIES.items():
        kinds[level] = (*kinds.get(level, ()), kind)
    return kinds


_KINDS_AT = _kinds_at()
"""The families whose topics begin with a level (after the job): the parsers ``parse`` tries."""


def parse(topic: str) -> TopicMatch:
    """The family and names of an EdgeMesh topic (a trailing ``chunk/{i}`` ignored); TopicError otherwise."""
    where = _Levels.of(topic)
    for kind in _KINDS_AT.get(where.rest[0], ()):
        found = where.as_kind(kind)
        if found is not None:
            return found
    raise TopicError(f"{topic!r} is not an EdgeMesh topic")


def parse_as(kind: TopicKind, topic: str) -> TopicMatch:
    """``parse(topic)``, its parser found by ``kind`` (the family of the filter it fell under) rather than by its
    levels: the same answer, one parser tried. A topic of another family (a filter of a family whose pattern takes
    others', ``#``) is parsed as ``parse`` does."""
    found = _Levels.of(topic).as_kind(kind)
    return found if found is not None else parse(topic)


def match(topic: str, filters: Sequence[Filter]) -> tuple[int, TopicMatch] | None:
    """The first of ``filters`` that ``topic`` falls under (a trailing ``chunk/{i}`` ignored), and the
    topic parsed; None when none does. Raises TopicError for a matching topic that is not EdgeMesh's."""
    base = base_topic(topic)
    for index, filter_ in enumerate(filters):
        if matches(filter_.pattern, base):
            return index, parse_as(filter_.kind, base)
    return None


def base_topic(topic: str) -> str:
    """``topic`` without a trailing ``chunk/{index}``."""
    parts = topic.split("/")
    if _has_chunk_suffix(parts):
        return "/".join(parts[:-2])
    return topic


def _has_chunk_suffix(parts: Sequence[str]) -> bool:
    """Levels end in ``chunk/{index}`` (a device, cluster or job may itself be named ``chunk``)."""
    return len(parts) >= 2 and parts[-2] == CHUNK_SEGMENT and parts[-1].isascii() and parts[-1].isdigit()


def matches(filter_: str, topic: str) -> bool:
    """MQTT topic filter matching (``+`` one level, ``#`` the rest)."""
    fparts = filter_.split("/")
    tparts = topic.split("/")
    for i, f in enumerate(fparts):
        if f == "#":
            return i <= len(tparts)
        if i >= len(tparts):
            return False
        if f != "+" and f != tparts[i]:
            return False
    return len(fparts) == len(tparts)
