"""Topic building, matching and parsing (docs/topics.md): one module builds and parses every topic a service uses."""

from __future__ import annotations

import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemesh.common.topics import (
    PREFIX,
    Filter,
    TopicError,
    TopicKind,
    TopicMatch,
    Topics,
    base_topic,
    check_name,
    match,
    matches,
    parse,
    parse_as,
    valid_name,
    valid_topic,
)

JOB = "lab-1"
T = Topics(JOB)
ROOT = f"edgemesh/v1/{JOB}/"


# --------------------------------------------------------------------------- builders


@pytest.mark.parametrize("built,relative", [
    (T.hello("pi-07"), "device/pi-07/hello"),
    (T.status("pi-07"), "device/pi-07/status"),
    (T.stats("pi-07"), "device/pi-07/stats"),
    (T.probe("pi-07"), "device/pi-07/probe"),
    (T.hello_filter().pattern, "device/+/hello"),
    (T.status_filter().pattern, "device/+/status"),
    (T.stats_filter().pattern, "device/+/stats"),
    (T.plan(), "plan"),
    (T.codec("pi-07"), "codec/pi-07"),
    (T.codec_filter().pattern, "codec/+"),
    (T.grad("c0", "pi-07"), "grad/c0/pi-07"),
    (T.grad_filter().pattern, "grad/+/+"),
    (T.grad_raw("c0", "pi-07"), "grad-raw/c0/pi-07"),
    (T.grad_raw_filter().pattern, "grad-raw/+/+"),
    (T.model(), "model"),
    (T.model_delta(), "model/delta"),
    (T.sync(), "sync"),
    (T.ack("pi-07"), "ack/pi-07"),
    (T.mesh("c0", "conv2", "fwd", "pi-07"), "mesh/c0/conv2/fwd/pi-07"),
    (T.cluster_mesh_filter("c0").pattern, "mesh/c0/#"),
    (T.control("ps"), "control/ps"),
    (T.control("all"), "control/all"),
    (T.control("device/pi-07"), "control/device/pi-07"),
    (T.control_reply("ops"), "control-reply/ops"),
    (T.events(), "events"),
])
def test_every_builder_yields_the_design_topic_under_the_job_root(built: str, relative: str) -> None:
    assert PREFIX == "edgemesh/v1"
    assert T.root == "edgemesh/v1/lab-1"
    assert built == ROOT + relative


def test_jobs_do_not_see_each_others_topics() -> None:
    other = Topics("lab-2")
    for filter_ in (T.hello_filter().pattern, T.grad_filter().pattern, T.cluster_mesh_filter("c0").pattern, T.plan()):
        assert not matches(filter_, other.hello("pi-1"))
        assert not matches(filter_, other.grad("c0", "pi-1"))
        assert not matches(filter_, other.mesh("c0", "l", "fwd", "pi-1"))
        assert not matches(filter_, other.plan())


def test_subscription_filters_match_what_the_builders_publish() -> None:
    assert matches(T.hello_filter().pattern, T.hello("pi-1"))
    assert not matches(T.hello_filter().pattern, T.stats("pi-1"))
    assert matches(T.status_filter().pattern, T.status("jetson.2"))
    assert matches(T.stats_filter().pattern, T.stats("x"))
    assert matches(T.codec_filter().pattern, T.codec("pi-1"))
    assert matches(T.grad_filter().pattern, T.grad("c0", "pi-1"))
    assert not matches(T.grad_filter().pattern, T.grad_raw("c0", "pi-1"))
    assert matches(T.grad_raw_filter().pattern, T.grad_raw("c0", "pi-1"))
    assert matches(T.cluster_mesh_filter("c0").pattern, T.mesh_backward("c0", "conv1", "pi-1", "pi-2"))
    assert not matches(T.cluster_mesh_filter("c0").pattern, T.mesh_backward("c1", "conv1", "pi-1", "pi-2"))
    assert matches(T.backward_filter("c0", "pi-1").pattern, T.mesh_backward("c0", "conv1", "pi-1", "pi-2"))
    assert not matches(T.backward_filter("c0", "pi-2").pattern, T.mesh_backward("c0", "conv1", "pi-1", "pi-2"))
    assert not matches(T.model(), T.model_delta())


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["a", "pi-07", "jetson_nano.2", "A9", "x" * 64, "chunk", "7"])
def test_valid_names(name: str) -> None:
    assert valid_name(name)
    assert check_name("device", name) == name
    assert Topics(name).root == f"edgemesh/v1/{name}"


@pytest.mark.parametrize("name", ["", "a/b", "a+b", "+", "#", "a#", "x" * 65, "-lead", ".lead", "_lead", "a b",
                                  "pi\u00e9", "a\x00b", "$SYS"])
def test_invalid_names_are_rejected(name: str) -> None:
    assert not valid_name(name)
    with pytest.raises(ValueError, match="invalid device name"):
        check_name("device", name)
    with pytest.raises(ValueError, match="invalid job name"):
        Topics(name)


# --------------------------------------------------------------------------- matching


@pytest.mark.parametrize("filter_,topic,expected", [
    ("a/b", "a/b", True),
    ("a/b", "a/c", False),
    ("a/b", "a/b/c", False),
    ("a/b/c", "a/b", False),
    ("a/+", "a/b", True),
    ("a/+", "a/b/c", False),  # + does not reach across levels
    ("a/+/c", "a/b/c", True),
    ("a/+/c", "a/b/x/c", False),
    ("+", "a", True),
    ("+", "a/b", False),
    ("+/+", "a/b", True),
    ("a/+", "a/", True),  # an empty level is a level
    ("a/+", "a", False),
    ("a/#", "a", True),  # '#' also matches the parent level
    ("a/#", "a/b", True),
    ("a/#", "a/b/c/d", True),
    ("a/#", "ab", False),
    ("a/#", "b/a", False),
    ("a/b/#", "a", False),
    ("#", "a", True),
    ("#", "a/b/c", True),
    ("+/#", "a", True),
    ("+/#", "a/b/c", True),
    ("A/b", "a/b", False),  # topics are case sensitive
    ("$SYS/#", "$SYS/broker/uptime", True),
    # $SYS is not special here (the MQTT spec keeps $-topics from '#' and '+' at the first level);
    # EdgeMesh topics never start with '$', so this never matters for routing
    ("#", "$SYS/broker/uptime", True),
    ("+/broker/uptime", "$SYS/broker/uptime", True),
])
def test_matches_follows_mqtt_wildcard_rules(filter_: str, topic: str, expected: bool) -> None:
    assert matches(filter_, topic) is expected


_LEVEL = st.text(alphabet="ab", max_size=2)


@settings(max_examples=200, deadline=None)
@given(levels=st.lists(_LEVEL, min_size=1, max_size=5), data=st.data())
def test_matches_a_filter_made_from_the_topic(levels: list[str], data: st.DataObject) -> None:
    topic = "/".join(levels)
    assert matches(topic, topic)
    # replacing any levels by '+' still matches; cutting the tail and appending '#' still matches
    plus = [lvl if not data.draw(st.booleans()) else "+" for lvl in levels]
    assert matches("/".join(plus), topic)
    keep = data.draw(st.integers(0, len(levels)))
    assert matches("/".join([*levels[:keep], "#"]), topic)
    # one level more or less never matches without '#'
    assert not matches("/".join([*plus, "+"]), topic)
    if len(levels) > 1:
        assert not matches("/".join(plus[:-1]), topic)


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("topic,expected", [
    (T.plan(), TopicMatch(JOB, "plan", T.plan())),
    (T.sync(), TopicMatch(JOB, "sync", T.sync())),
    (T.model(), TopicMatch(JOB, "model", T.model())),
    (T.events(), TopicMatch(JOB, "events", T.events())),
    (T.hello("pi-1"), TopicMatch(JOB, "hello", T.hello("pi-1"), device="pi-1")),
    (T.status("pi-1"), TopicMatch(JOB, "status", T.status("pi-1"), device="pi-1")),
    (T.stats("pi-1"), TopicMatch(JOB, "stats", T.stats("pi-1"), device="pi-1")),
    (T.probe("pi-1"), TopicMatch(JOB, "probe", T.probe("pi-1"), device="pi-1")),
    (T.codec("pi-4"), TopicMatch(JOB, "codec", T.codec("pi-4"), device="pi-4")),
    (T.ack("pi-5"), TopicMatch(JOB, "ack", T.ack("pi-5"), device="pi-5")),
    (T.model_delta(), TopicMatch(JOB, "delta", T.model_delta())),
    (T.model_delta_for("w1"), TopicMatch(JOB, "delta", T.model_delta_for("w1"), device="w1")),
    (T.grad("c0", "pi-1"), TopicMatch(JOB, "grad", T.grad("c0", "pi-1"), device="pi-1", cluster="c0")),
    (T.grad_raw("c1", "pi-7"), TopicMatch(JOB, "grad_raw", T.grad_raw("c1", "pi-7"), device="pi-7", cluster="c1")),
    (T.mesh("m-a", "conv1", "fwd", "a"), TopicMatch(JOB, "mesh", T.mesh("m-a", "conv1", "fwd", "a"), device="a",
                                                    cluster="m-a", layer="conv1", phase="fwd")),
    (T.control("ps"), TopicMatch(JOB, "control", T.control("ps"), target="ps")),
    (T.control("all"), TopicMatch(JOB, "control", T.control("all"), target="all")),
    (T.control("device/pi-1"), TopicMatch(JOB, "control", T.control("device/pi-1"), device="pi-1",
                                          target="device/pi-1")),
    (T.control_reply("ops"), TopicMatch(JOB, "reply", T.control_reply("ops"), target="ops")),
])
def test_parse_names_the_family_and_the_names_of_every_topic(topic: str, expected: TopicMatch) -> None:
    assert parse(topic) == expected
    # a retained chunk of it parses as the topic itself
    assert parse(T.chunk(topic, 3)) == expected


def test_chunk_topics() -> None:
    assert T.chunk(T.model(), 4) == ROOT + "model/chunk/4"
    assert base_topic(T.chunk(T.model(), 4)) == T.model()
    assert base_topic(T.model()) == T.model()
    assert base_topic(T.hello("pi-1")) == T.hello("pi-1")


def test_a_device_cluster_or_job_named_chunk_is_not_mistaken_for_a_chunk_suffix() -> None:
    """'chunk' is a valid name; only ``chunk/{index}`` at the end is a chunk suffix."""
    assert parse(T.hello("chunk")).device == "chunk"
    assert parse(T.grad("chunk", "pi-1")) == TopicMatch(JOB, "grad", T.grad("chunk", "pi-1"), device="pi-1",
                                                        cluster="chunk")
    assert base_topic(T.hello("chunk")) == T.hello("chunk")
    job = Topics("chunk")
    assert base_topic(job.plan()) == job.plan()
    assert parse(job.plan()) == TopicMatch("chunk", "plan", job.plan())
    assert base_topic(job.chunk(job.plan(), 0)) == job.plan()


@pytest.mark.parametrize("topic", [
    "edgemesh/v1/lab-1",  # the root itself has no levels below it
    "edgemesh/v2/lab-1/plan",
    "other/edgemesh/v1/lab-1/plan",
    "",
    ROOT + "device/pi-1",
    ROOT + "grad/c0",
    ROOT + "device/pi-1/hello/extra",
    ROOT + "control/nobody",
    ROOT + "mesh/c/l/fwd",
    ROOT + "unknown",
    "edgemesh/v1/bad+job/plan",
])
def test_parse_refuses_a_topic_that_is_not_edgemeshs(topic: str) -> None:
    with pytest.raises(TopicError):
        parse(topic)


EVERY_FAMILY = [T.plan(), T.sync(), T.model(), T.events(), T.hello("pi-1"), T.status("pi-1"), T.stats("pi-1"),
                T.evaluation("pi-1"), T.snapshot_request("pi-1"), T.probe("pi-1"), T.codec("pi-4"), T.ack("pi-5"),
                T.model_delta(), T.model_delta_for("w1"), T.grad("c0", "pi-1"), T.grad_raw("c1", "pi-7"),
                T.mesh("m-a", "conv1", "fwd", "a"), T.mesh_backward("m-a", "conv1", "b", "c"), T.control("ps"),
                T.control("device/pi-1"), T.control_reply("ops"), T.device_reply(T.control_reply("ops"), "pi-1"),
                T.job_file(), T.job_state(), T.job_model(), T.steps(), T.for_shard(2).norms(),
                T.for_shard(1).grad("c", "d"), T.for_shard(1).ack("d"), T.for_shard(3).model(),
                T.for_shard(1).model_delta(), T.chunk(T.model(), 2)]
"""A topic of every family, a shard's among them."""


def test_every_family_is_parsed_and_parsing_by_a_family_gives_what_parse_gives() -> None:
    """The router parses a topic by the kind of the filter it fell under: for a topic of that family the parser of
    its family alone, for any other (a filter whose pattern takes others' topics) as ``parse`` does."""
    kinds = set(typing.get_args(TopicKind))
    assert {parse(topic).kind for topic in EVERY_FAMILY} == kinds
    for topic in EVERY_FAMILY:
        for kind in kinds:
            assert parse_as(kind, topic) == parse(topic), (kind, topic)
    for bad in (ROOT + "unknown", ROOT + "control/nobody", ROOT + "shard/1/plan", ROOT + "steps"):
        for kind in ("plan", "control", "steps"):
            with pytest.raises(TopicError):
                parse_as(kind, bad)


def test_match_finds_the_first_filter_a_topic_falls_under_and_parses_it_once() -> None:
    filters = [T.plan_filter(), T.grad_filter(), T.control_filter("ps"), T.control_filter("all")]
    assert match(T.grad("c0", "pi-1"), filters) == (1, parse(T.grad("c0", "pi-1")))
    assert match(T.chunk(T.plan(), 2), filters) == (0, parse(T.plan()))
    assert match(T.control("all"), filters) == (3, parse(T.control("all")))
    assert match(T.hello("pi-1"), filters) is None
    assert match(Topics("lab-2").plan(), filters) is None  # another job's plan
    with pytest.raises(TopicError):  # falls under a filter, but is no topic of ours
        match(ROOT + "grad/c0", [Filter(ROOT + "#", "grad")])


def test_a_topic_match_tells_when_a_body_contradicts_it() -> None:
    class Body:
        def __init__(self, **fields: str) -> None:
            self.__dict__.update(fields)

    where = parse(T.grad("c0", "pi-1"))
    assert where.disagreement(Body(device="pi-1", cluster="c0")) is None
    assert "device" in (where.disagreement(Body(device="pi-2", cluster="c0")) or "")
    assert "cluster" in (where.disagreement(Body(device="pi-1", cluster="c9")) or "")
    assert where.disagreement(Body(device="")) is None  # a field the body leaves empty says nothing
    mesh = parse(T.mesh_backward("m-a", "conv1", "b", "c"))
    assert (mesh.device, mesh.target, mesh.phase) == ("c", "b", "bwd")  # the sender, as a forward slice's
    assert mesh.disagreement(Body(cluster="m-a", layer="conv1", phase="bwd")) is None
    assert "layer" in (mesh.disagreement(Body(cluster="m-a", layer="conv2", phase="bwd")) or "")
    assert "phase" in (mesh.disagreement(Body(cluster="m-a", layer="conv1", phase="fwd")) or "")
    assert parse(T.plan()).disagreement(Body(device="anyone")) is None  # the topic names no device


# --------------------------------------------------------------------------- filters


def test_a_filter_subscribes_to_its_topic_and_its_retained_chunks() -> None:
    model = T.model_filter()
    assert model.patterns == (T.model(), ROOT + "model/chunk/+")
    assert T.grad_filter().patterns == (ROOT + "grad/+/+", ROOT + "grad/+/+/chunk/+")
    assert model.matches(T.model()) and not model.matches(T.model_delta())
    assert any(matches(p, T.chunk(T.model(), 9)) for p in model.patterns)
    assert T.delta_filter().matches(T.model_delta()) and not T.delta_filter().matches(T.model_delta_for("w1"))
    assert T.delta_filter("w1").matches(T.model_delta_for("w1"))
    assert T.ack_filter("+").matches(T.ack("pi-1")) and T.ack_filter("pi-1").matches(T.ack("pi-1"))
    assert T.codec_filter("pi-1").matches(T.codec("pi-1")) and not T.codec_filter("pi-1").matches(T.codec("pi-2"))
    assert T.mesh_filter("m-a", "+", "fwd", "b").matches(T.mesh("m-a", "conv1", "fwd", "b"))
    assert not T.mesh_filter("m-a", "+", "fwd", "b").matches(T.mesh("m-a", "step", "begin", "b"))
    assert T.reply_filter("ops").matches(T.control_reply("ops")) and T.events_filter().matches(T.events())
    assert T.sync_filter().kind == "sync" and T.grad_raw_filter().kind == "grad_raw"


def test_a_multilevel_filter_needs_no_chunk_pattern() -> None:
    """``#`` already covers the chunk topics."""
    mesh = T.cluster_mesh_filter("c0")
    assert mesh.patterns == (mesh.pattern,)
    assert mesh.matches(T.chunk(T.mesh("c0", "l1", "fwd", "pi-1"), 3))


@pytest.mark.parametrize("topic,ok", [
    (T.control_reply("ops"), True),
    ("anything/at/all", True),
    ("a/+/b", False),
    ("#", False),
    ("a/#", False),
    ("", False),
    ("x" * 1024, True),
    ("x" * 1025, False),
    ("a\x00b", False),
])
def test_valid_topic(topic: str, ok: bool) -> None:
    assert valid_topic(topic) is ok
