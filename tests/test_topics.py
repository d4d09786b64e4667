"""Topic building and matching (DESIGN.md §2): one module builds every topic a service uses."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemesh.common.topics import PREFIX, Topics, base_topic, check_name, matches, valid_name

JOB = "lab-1"
T = Topics(JOB)
ROOT = f"edgemesh/v1/{JOB}/"


# --------------------------------------------------------------------------- builders


@pytest.mark.parametrize("built,relative", [
    (T.hello("pi-07"), "device/pi-07/hello"),
    (T.status("pi-07"), "device/pi-07/status"),
    (T.stats("pi-07"), "device/pi-07/stats"),
    (T.all_hello(), "device/+/hello"),
    (T.all_status(), "device/+/status"),
    (T.all_stats(), "device/+/stats"),
    (T.plan(), "plan"),
    (T.codec("pi-07"), "codec/pi-07"),
    (T.all_codec(), "codec/+"),
    (T.grad("c0", "pi-07"), "grad/c0/pi-07"),
    (T.all_grad(), "grad/+/+"),
    (T.grad_raw("c0", "pi-07"), "grad-raw/c0/pi-07"),
    (T.all_grad_raw(), "grad-raw/+/+"),
    (T.model(), "model"),
    (T.model_delta(), "model/delta"),
    (T.sync(), "sync"),
    (T.ack("pi-07"), "ack/pi-07"),
    (T.mesh("c0", "conv2", "fwd", "pi-07"), "mesh/c0/conv2/fwd/pi-07"),
    (T.cluster_mesh("c0"), "mesh/c0/#"),
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
    for filter_ in (T.all_hello(), T.all_grad(), T.cluster_mesh("c0"), T.plan()):
        assert not matches(filter_, other.hello("pi-1"))
        assert not matches(filter_, other.grad("c0", "pi-1"))
        assert not matches(filter_, other.mesh("c0", "l", "fwd", "pi-1"))
        assert not matches(filter_, other.plan())


def test_subscription_filters_match_what_the_builders_publish() -> None:
    assert matches(T.all_hello(), T.hello("pi-1"))
    assert not matches(T.all_hello(), T.stats("pi-1"))
    assert matches(T.all_status(), T.status("jetson.2"))
    assert matches(T.all_stats(), T.stats("x"))
    assert matches(T.all_codec(), T.codec("pi-1"))
    assert matches(T.all_grad(), T.grad("c0", "pi-1"))
    assert not matches(T.all_grad(), T.grad_raw("c0", "pi-1"))
    assert matches(T.all_grad_raw(), T.grad_raw("c0", "pi-1"))
    assert matches(T.cluster_mesh("c0"), T.mesh("c0", "conv1", "bwd", "pi-1"))
    assert not matches(T.cluster_mesh("c0"), T.mesh("c1", "conv1", "bwd", "pi-1"))
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


@pytest.mark.parametrize("topic,parts", [
    (T.plan(), ["plan"]),
    (T.hello("pi-1"), ["device", "pi-1", "hello"]),
    (T.grad("c0", "pi-1"), ["grad", "c0", "pi-1"]),
    (T.model_delta(), ["model", "delta"]),
    (T.chunk(T.model(), 0), ["model"]),
    (T.chunk(T.model(), 12), ["model"]),
    (T.chunk(T.hello("pi-1"), 3), ["device", "pi-1", "hello"]),
    (T.chunk(T.grad("c0", "pi-1"), 7), ["grad", "c0", "pi-1"]),
    (T.control("device/pi-1"), ["control", "device", "pi-1"]),
])
def test_relative_gives_levels_below_the_root_without_the_chunk_suffix(topic: str, parts: list[str]) -> None:
    assert T.relative(topic) == parts


def test_chunk_topics() -> None:
    assert T.chunk(T.model(), 4) == ROOT + "model/chunk/4"
    assert base_topic(T.chunk(T.model(), 4)) == T.model()
    assert base_topic(T.model()) == T.model()
    assert base_topic(T.hello("pi-1")) == T.hello("pi-1")


def test_a_device_cluster_or_job_named_chunk_is_not_mistaken_for_a_chunk_suffix() -> None:
    """'chunk' is a valid name; only ``chunk/{index}`` at the end is a chunk suffix."""
    assert T.relative(T.hello("chunk")) == ["device", "chunk", "hello"]
    assert T.device_of(T.hello("chunk")) == "chunk"
    assert T.device_of(T.grad("chunk", "pi-1")) == "pi-1"
    assert base_topic(T.hello("chunk")) == T.hello("chunk")
    job = Topics("chunk")
    assert base_topic(job.plan()) == job.plan()
    assert job.relative(job.plan()) == ["plan"]
    assert base_topic(job.chunk(job.plan(), 0)) == job.plan()


@pytest.mark.parametrize("topic,device", [
    (T.hello("pi-1"), "pi-1"),
    (T.status("pi-2"), "pi-2"),
    (T.stats("pi-3"), "pi-3"),
    (T.codec("pi-4"), "pi-4"),
    (T.ack("pi-5"), "pi-5"),
    (T.grad("c0", "pi-6"), "pi-6"),
    (T.grad_raw("c1", "pi-7"), "pi-7"),
    (T.chunk(T.grad("c0", "pi-8"), 2), "pi-8"),
    (T.chunk(T.codec("pi-9"), 0), "pi-9"),
])
def test_device_of(topic: str, device: str) -> None:
    assert T.device_of(topic) == device


@pytest.mark.parametrize("topic", [T.plan(), T.model(), T.events(), T.control("ps"),
                                   ROOT + "device/pi-1", ROOT + "grad/c0", ROOT + "device/pi-1/hello/extra"])
def test_device_of_a_topic_naming_no_device_raises(topic: str) -> None:
    with pytest.raises(ValueError):
        T.device_of(topic)


@pytest.mark.parametrize("topic", [
    Topics("lab-2").hello("pi-1"),
    Topics("lab-10").plan(),  # a job whose name starts with this one's
    "edgemesh/v1/lab-1",  # the root itself has no levels below it
    "edgemesh/v2/lab-1/plan",
    "other/edgemesh/v1/lab-1/plan",
    "",
])
def test_topics_outside_the_job_raise(topic: str) -> None:
    with pytest.raises(ValueError, match="outside job"):
        T.relative(topic)
    with pytest.raises(ValueError):
        T.device_of(topic)


# --------------------------------------------------------------------------- chunk filters


def test_with_chunks_adds_the_chunk_filter() -> None:
    assert Topics.with_chunks(T.model()) == [T.model(), ROOT + "model/chunk/+"]
    assert Topics.with_chunks(T.all_grad()) == [T.all_grad(), ROOT + "grad/+/+/chunk/+"]
    for filter_ in Topics.with_chunks(T.model()):
        assert not matches(filter_, T.model_delta())
    assert any(matches(f, T.chunk(T.model(), 9)) for f in Topics.with_chunks(T.model()))
    assert any(matches(f, T.chunk(T.grad("c0", "pi-1"), 0)) for f in Topics.with_chunks(T.all_grad()))


def test_with_chunks_keeps_a_multilevel_filter_alone() -> None:
    """``#`` already covers the chunk topics."""
    assert Topics.with_chunks(T.cluster_mesh("c0")) == [T.cluster_mesh("c0")]
    assert matches(T.cluster_mesh("c0"), T.chunk(T.mesh("c0", "l1", "fwd", "pi-1"), 3))
