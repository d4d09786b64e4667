"""Every MQTT topic and subscription filter EdgeMesh uses, built in one place (DESIGN.md §2).

All topics live under ``edgemesh/v1/{job}/`` so several trainings can share one broker.
Large retained messages are chunked onto ``{topic}/chunk/{index}`` (see ``wire``); the
``*_filters`` helpers return both the topic and its chunk filter so subscribers get either.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

PREFIX = "edgemesh/v1"
CHUNK_SEGMENT = "chunk"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def valid_name(name: str) -> bool:
    """A job, device or cluster name: 1-64 chars of ``[A-Za-z0-9_.-]``, no MQTT wildcards or ``/``."""
    return bool(_NAME.match(name))


def check_name(kind: str, name: str) -> str:
    if not valid_name(name):
        raise ValueError(f"invalid {kind} name {name!r}: use 1-64 characters of A-Z a-z 0-9 _ . -")
    return name


@dataclass(frozen=True, slots=True)
class Topics:
    """Topic builder for one job."""

    job: str

    def __post_init__(self) -> None:
        check_name("job", self.job)

    @property
    def root(self) -> str:
        return f"{PREFIX}/{self.job}"

    # --- devices -----------------------------------------------------------------------
    def hello(self, device: str) -> str:
        return f"{self.root}/device/{device}/hello"

    def status(self, device: str) -> str:
        return f"{self.root}/device/{device}/status"

    def stats(self, device: str) -> str:
        return f"{self.root}/device/{device}/stats"

    def all_hello(self) -> str:
        return f"{self.root}/device/+/hello"

    def all_status(self) -> str:
        return f"{self.root}/device/+/status"

    def all_stats(self) -> str:
        return f"{self.root}/device/+/stats"

    # --- plan, codec, model --------------------------------------------------------------
    def plan(self) -> str:
        return f"{self.root}/plan"

    def codec(self, device: str) -> str:
        return f"{self.root}/codec/{device}"

    def all_codec(self) -> str:
        return f"{self.root}/codec/+"

    def model(self) -> str:
        return f"{self.root}/model"

    def model_delta(self) -> str:
        return f"{self.root}/model/delta"

    def model_delta_for(self, device: str) -> str:
        """A model-parallel member's part of every delta: the blocks of the rows it trains."""
        return f"{self.root}/model/delta/{device}"

    def sync(self) -> str:
        """The parameter server's retained ``SyncState`` (policy, bound, deadline, delay indices)."""
        return f"{self.root}/sync"

    # --- gradients and acks ----------------------------------------------------------------
    def grad(self, cluster: str, device: str) -> str:
        return f"{self.root}/grad/{cluster}/{device}"

    def all_grad(self) -> str:
        return f"{self.root}/grad/+/+"

    def grad_raw(self, cluster: str, device: str) -> str:
        return f"{self.root}/grad-raw/{cluster}/{device}"

    def all_grad_raw(self) -> str:
        return f"{self.root}/grad-raw/+/+"

    def ack(self, device: str) -> str:
        return f"{self.root}/ack/{device}"

    # --- model-parallel mesh ---------------------------------------------------------------
    def mesh(self, cluster: str, layer: str, phase: str, device: str) -> str:
        return f"{self.root}/mesh/{cluster}/{layer}/{phase}/{device}"

    def cluster_mesh(self, cluster: str) -> str:
        return f"{self.root}/mesh/{cluster}/#"

    def mesh_member(self, cluster: str, device: str, members: Sequence[str]) -> list[str]:
        """What a member of ``cluster`` subscribes to: the other members' forward slices, step
        starts and readiness (one filter each, so its own do not come back), and the backward
        slices addressed to it."""
        others = [m for m in members if m != device]
        return [*(f"{self.root}/mesh/{cluster}/+/fwd/{m}" for m in others),
                *(f"{self.root}/mesh/{cluster}/step/begin/{m}" for m in others),
                *(f"{self.root}/mesh/{cluster}/step/ready/{m}" for m in others),
                f"{self.root}/mesh/{cluster}/+/bwd/{device}"]

    # --- operations ------------------------------------------------------------------------
    def control(self, target: str) -> str:
        """``target`` is planner | ps | compressor | all | device/{id}."""
        return f"{self.root}/control/{target}"

    def control_reply(self, requester: str) -> str:
        return f"{self.root}/control-reply/{requester}"

    def events(self) -> str:
        return f"{self.root}/events"

    # --- chunking --------------------------------------------------------------------------
    @staticmethod
    def chunk(topic: str, index: int) -> str:
        return f"{topic}/{CHUNK_SEGMENT}/{index}"

    @staticmethod
    def with_chunks(filter_: str) -> list[str]:
        """A subscription filter plus the filter for its retained chunks."""
        if filter_.endswith("#"):
            return [filter_]
        return [filter_, f"{filter_}/{CHUNK_SEGMENT}/+"]

    # --- parsing ---------------------------------------------------------------------------
    def relative(self, topic: str) -> list[str]:
        """The topic's levels below the job root, with a trailing ``chunk/{i}`` removed.

        Raises ValueError for a topic outside this job.
        """
        prefix = self.root + "/"
        if not topic.startswith(prefix):
            raise ValueError(f"topic {topic!r} is outside job {self.job!r}")
        parts = topic[len(prefix):].split("/")
        if _has_chunk_suffix(parts):
            parts = parts[:-2]
        return parts

    def device_of(self, topic: str) -> str:
        """The device segment of a ``device/{d}/...``, ``codec/{d}``, ``ack/{d}`` or ``grad/{c}/{d}`` topic."""
        parts = self.relative(topic)
        match parts:
            case ["device", device, _] | ["codec", device] | ["ack", device]:
                return device
            case ["grad" | "grad-raw", _cluster, device]:
                return device
        raise ValueError(f"topic {topic!r} names no device")


def base_topic(topic: str) -> str:
    """``topic`` without a trailing ``chunk/{index}``."""
    parts = topic.split("/")
    if _has_chunk_suffix(parts):
        return "/".join(parts[:-2])
    return topic


def _has_chunk_suffix(parts: list[str]) -> bool:
    """Levels end in ``chunk/{index}`` (a device, cluster or job may itself be named ``chunk``)."""
    return len(parts) >= 2 and parts[-2] == CHUNK_SEGMENT and parts[-1].isascii() and parts[-1].isdigit()


def matches(filter_: str, topic: str) -> bool:
    """MQTT topic filter matching (``+`` one level, ``#`` the rest)."""
    fparts = filter_.split("/")
    tparts = topic.split("/")
    for i, f in enumerate(fparts):
        if f == "#":
            return i < len(tparts) or (i == len(tparts))
        if i >= len(tparts):
            return False
        if f != "+" and f != tparts[i]:
            return False
    return len(fparts) == len(tparts)
