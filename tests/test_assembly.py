"""Model-parallel shard assembly: the members' shards of a cluster step joined into one update
(``parameter_server/assembly.py``, pure), then the parameter server doing it on real brokers."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np
from helpers import SPLIT, devices, gradient, make_config, member_update, mesh_plan, plan_for, running

from edgemesh.common.config import Config
from edgemesh.common.messages import GradientUpdate, ShardUpdate, StepDiscard
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.parameter_server.assembly import CLOSED_STEPS, Assembly, Outcome
from edgemesh.services.parameter_server.optimizer import ShardGrad
from edgemesh.services.parameter_server.scheduler import Ack, Candidate, Clock
from edgemesh.services.parameter_server.service import ParameterServer

JOB = "pstest"

# --------------------------------------------------------------------------- the assembly (pure)

ROWS = {"w": 6, "v": 3}
"""A model of two parameters, by rows."""
A = {"w": (0, 4), "v": (0, 1)}
B = {"w": (4, 6), "v": (1, 3)}
"""Two members' rows: together they tile ``ROWS``."""


def part(device: str, rows: dict[str, tuple[int, int]], *, seq: int = 1, base: int = 0, step: int = 1,
         plan_version: int = 1, need_snapshot: bool = False, received: float = 0.0) -> Candidate:
    """Member ``device``'s part of model-parallel ``step`` of cluster ``m-a``: a gradient of ones on ``rows``."""
    shards = tuple(ShardUpdate(param=p, start=a, stop=b, codec="none", data=np.ones(b - a, np.float32).tobytes())
                   for p, (a, b) in rows.items())
    u = GradientUpdate(device=device, cluster="m-a", incarnation=1, seq=seq, base_version=base, samples=8,
                       shards=shards, need_snapshot=need_snapshot, mesh_step=step, plan_version=plan_version)
    return Candidate(u, [ShardGrad(p, a, b, np.ones(b - a, np.float32)) for p, (a, b) in rows.items()], received)


def told(acks: list[Ack]) -> list[tuple[str, str, str, bool]]:
    """(device, status, reason, resync) of every ack."""
    return [(a.update.device, a.status, a.reason, a.resync) for a in acks]


def nothing(out: Outcome) -> bool:
    """Whether a call settled nothing: no joined update, no ack."""
    return not out.joined and not out.acks and not out.rejected


def test_a_step_is_joined_once_its_members_shards_tile_the_model() -> None:
    assembly, clock = Assembly(ROWS, timeout_s=5.0), Clock()
    assert assembly.timeout(0.0) is None
    assert nothing(assembly.add(part("b", B, base=3, received=2.0), clock, 1, 0.0))
    assert len(assembly) == 1 and assembly.timeout(1.0) == 4.0  # half a model waits
    assert nothing(assembly.add(part("a", A, step=2), clock, 1, 0.0))  # another step is another step
    out = assembly.add(part("a", A, base=2, need_snapshot=True, received=1.0), clock, 1, 1.0)
    [joined] = out.joined
    assert not out.acks and not out.rejected
    assert len(assembly) == 1  # step 2 still waits
    # one update for the cluster: the members' shards, the oldest base, a snapshot if any member missed a delta
    assert [u.device for u in joined.updates] == ["a", "b"]
    u = joined.update
    assert (u.device, u.cluster, u.mesh_step, u.base_version, u.need_snapshot) == ("a", "m-a", 1, 2, True)
    assert [(s.param, s.start, s.stop) for s in u.shards] == [("w", 0, 4), ("v", 0, 1), ("w", 4, 6), ("v", 1, 3)]
    assert [(g.param, g.start, g.stop) for g in joined.grads] == [(s.param, s.start, s.stop) for s in u.shards]
    assert joined.received == 2.0
    # a resend of a part of the joined step opens no new one: it is acked with the cluster's update
    assert assembly.taken(part("b", B, base=3).update, clock)
    assert nothing(assembly.add(part("b", B, base=3), clock, 1, 2.0))
    assert len(assembly) == 1
    # once applied, it is a duplicate
    clock.advance([joined])
    assert not assembly.taken(part("b", B, base=3).update, clock)
    assert told(assembly.add(part("b", B, base=3), clock, 1, 3.0).acks) == [("b", "duplicate", "", False)]


def test_overlapping_shards_reject_the_step_as_shape() -> None:
    assembly, clock = Assembly(ROWS, timeout_s=5.0), Clock()
    assert nothing(assembly.add(part("a", A), clock, 1, 0.0))
    out = assembly.add(part("b", {"w": (3, 6), "v": (1, 3)}), clock, 1, 0.0)  # w[3] twice
    assert not out.joined and not out.acks
    # both members told, as rejections the service counts
    assert told(out.rejected) == [("a", "discarded", "shape", True), ("b", "discarded", "shape", True)]
    assert len(assembly) == 0
    # a resend of a part is told the same at once, and counted the same
    assert told(assembly.add(part("a", A), clock, 1, 1.0).rejected) == [("a", "discarded", "shape", True)]
    assert len(assembly) == 0


def test_a_step_not_complete_in_time_expires_as_incomplete() -> None:
    assembly, clock = Assembly(ROWS, timeout_s=5.0), Clock()
    assert nothing(assembly.add(part("a", A), clock, 1, 10.0))
    assert assembly.timeout(12.0) == 3.0
    assert nothing(assembly.expire(14.9)) and len(assembly) == 1
    out = assembly.expire(15.0)
    assert told(out.rejected) == [("a", "discarded", "incomplete", True)] and not out.acks
    assert len(assembly) == 0 and assembly.timeout(15.0) is None
    # the rest of the step, late, and a's resend: told at once and counted, no new step opened
    assert told(assembly.add(part("b", B), clock, 1, 16.0).rejected) == [("b", "discarded", "incomplete", True)]
    assert told(assembly.add(part("a", A), clock, 1, 16.0).rejected) == [("a", "discarded", "incomplete", True)]
    assert len(assembly) == 0


def test_a_new_plan_discards_the_steps_of_older_plans_at_once() -> None:
    assembly, clock = Assembly(ROWS, timeout_s=600.0), Clock()
    assert nothing(assembly.add(part("a", A, step=7), clock, 1, 0.0))
    # a part computed under a plan the PS has not received yet is not from the past: it waits
    assert nothing(assembly.add(part("a", A, seq=2, plan_version=2), clock, 1, 0.0))
    out = assembly.replanned(2)
    # acked, not counted as rejections: the members abandoned the step
    assert told(out.acks) == [("a", "discarded", "replanned", True)] and not out.rejected
    assert len(assembly) == 1  # the step of plan 2 waits on
    # b's part of the replaced step, late, and a part of a step of that plan never opened: told at once
    assert told(assembly.add(part("b", B, step=7), clock, 2, 1.0).acks) == [("b", "discarded", "replanned", True)]
    assert told(assembly.add(part("b", B, step=8), clock, 2, 1.0).acks) == [("b", "discarded", "replanned", True)]
    assert len(assembly) == 1
    assert len(assembly.add(part("b", B, seq=2, plan_version=2), clock, 2, 1.0).joined) == 1
    assert len(assembly) == 0


def test_a_resend_of_a_joined_step_the_scheduler_discarded_hears_why() -> None:
    assembly, clock = Assembly(ROWS, timeout_s=5.0), Clock()
    assembly.add(part("a", A), clock, 1, 0.0)
    [joined] = assembly.add(part("b", B), clock, 1, 0.0).joined
    assembly.discarded(joined.update, "stale")
    assert told(assembly.add(part("b", B), clock, 1, 1.0).acks) == [("b", "discarded", "stale", True)]
    assert len(assembly) == 0


def test_on_a_parameter_server_shard_a_step_waits_for_every_members_part_and_for_its_plan() -> None:
    """A sharded server's shard joins a step once every member of the cluster sent its part, empty from a member
    with none of the shard's rows: the joined update is the same member's on every shard (how shard 0's steps
    name it to the others), not that of whoever happened to complete the rows."""
    assembly, clock = Assembly(ROWS, timeout_s=5.0), Clock()
    known: dict[int, frozenset[str]] = {}
    assembly.members = lambda cluster, version: known.get(version)
    assert nothing(assembly.add(part("b", B), clock, 1, 0.0))
    assert nothing(assembly.add(part("c", A), clock, 1, 0.0))  # the rows are tiled; who the members are is unknown
    known[1] = frozenset({"a", "b", "c"})
    assert nothing(assembly.replanned(1))  # the plan came: a's part is still to come
    [joined] = assembly.add(part("a", {}), clock, 1, 0.0).joined  # a has none of this shard's rows
    assert joined.update.device == "a" and [u.device for u in joined.updates] == ["a", "b", "c"]
    assert [(s.param, s.start, s.stop) for s in joined.update.shards] == [("w", 4, 6), ("v", 1, 3), ("w", 0, 4),
                                                                          ("v", 0, 1)]
    # every part of a step of a plan not known yet: joined when the plan comes
    for device, rows in (("a", {}), ("b", B), ("c", A)):
        assert nothing(assembly.add(part(device, rows, seq=2, plan_version=2), clock, 1, 1.0))
    known[2] = frozenset({"a", "b", "c"})
    [joined] = assembly.replanned(2).joined
    assert joined.update.seq == 2 and len(assembly) == 0


def test_a_follower_shard_joins_a_step_of_a_replaced_plan_whose_last_parts_come_after_the_plan() -> None:
    """Shard 0 may join a step before the new plan reaches it while the step's last parts reach another shard
    after the plan: that shard joins it still (shard 0's step record will name it), and a step of a replaced plan
    that never completes expires there uncounted, as its members abandoned it."""
    assembly, clock = Assembly(ROWS, timeout_s=5.0), Clock()
    assembly.follows = True
    assembly.members = lambda cluster, version: frozenset({"a", "b"}) if version in (1, 2) else None
    assert nothing(assembly.add(part("a", A, step=12), clock, 1, 0.0))
    assert nothing(assembly.add(part("a", A, step=13), clock, 1, 0.0))
    assert nothing(assembly.replanned(2))  # neither step is dropped here
    [joined] = assembly.add(part("b", B, step=12), clock, 2, 1.0).joined  # late, under plan 2: joined still
    assert joined.update.mesh_step == 12 and joined.update.plan_version == 1
    assert nothing(assembly.expire(4.9, plan_version=2))
    out = assembly.expire(5.0, plan_version=2)  # step 13's b never came: abandoned, not a rejection
    assert told(out.acks) == [("a", "discarded", "replanned", True)] and not out.rejected
    assert len(assembly) == 0
    # a step shard 0 discarded (its plan replaced there first) goes at once, with shard 0's reason
    assert nothing(assembly.add(part("a", A, seq=5, step=14), clock, 1, 6.0))
    assert not assembly.dismiss([StepDiscard(device="b", incarnation=1, seq=5, reason="replanned")])  # not held
    assert assembly.dismiss([StepDiscard(device="a", incarnation=1, seq=5, reason="replanned")])
    assert assembly.timeout(6.0) == 0.0
    assert told(assembly.expire(6.0, plan_version=2).acks) == [("a", "discarded", "replanned", True)]
    # shard 0 (not following) drops the old plan's steps at once, as before
    leader = Assembly(ROWS, timeout_s=5.0)
    leader.add(part("a", A, step=12), clock, 1, 0.0)
    assert told(leader.replanned(2).acks) == [("a", "discarded", "replanned", True)]


def test_the_assembly_remembers_the_last_closed_steps_only() -> None:
    assembly, clock = Assembly(ROWS, timeout_s=1.0), Clock()
    for step in range(1, CLOSED_STEPS + 2):
        assembly.add(part("a", A, step=step), clock, 1, 0.0)
    assert len(told(assembly.expire(1.0).rejected)) == CLOSED_STEPS + 1
    # the newest closed steps are remembered; the oldest is forgotten: its resend opens a step again
    assert told(assembly.add(part("a", A, step=2), clock, 1, 2.0).rejected) == [("a", "discarded", "incomplete",
                                                                                  True)]
    assert nothing(assembly.add(part("a", A, step=1), clock, 1, 2.0)) and len(assembly) == 1


# --------------------------------------------------------------------------- the parameter server


def ps_config(broker: BrokerProcess, tmp_path: Path, **settings: object) -> Config:
    # a snapshot per version: these tests read the model the PS publishes after every step
    return make_config(broker, job=JOB, **{"ps.state_dir": tmp_path / "ps", "ps.eval_every": 0,
                                           "ps.broadcast": "snapshot", "training.sync_policy": "sync", **settings})


async def test_ps_applies_a_cluster_step_once_all_members_shards_are_in(broker: BrokerProcess,
                                                                         tmp_path: Path) -> None:
    cfg = ps_config(broker, tmp_path)
    ps = ParameterServer(cfg)
    async with running(ps), devices(cfg, ["a", "b"]) as c:
        await c.publish(c.topics.plan(), mesh_plan(["a", "b"], SPLIT), retain=True)
        await c.version_at_least(0)
        before = {k: v.copy() for k, v in ps.state.params.items()}  # type: ignore[union-attr]
        await c.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 1, 0))
        await c.until("a's shards held", lambda: ps.metrics.value("edgemesh_ps_mesh_assembling_steps") == 1)
        assert ps.version == 0  # half a model is not an update
        acks = await asyncio.gather(c.push(member_update("b", 1, 1, 0)), c.ack_for("a", 1))
        assert {a.status for a in acks} == {"accepted"}
        assert ps.version == 1  # one version for the cluster, not one per member
        after = ps.state.params  # type: ignore[union-attr]
        assert all(not np.array_equal(before[k], after[k]) for k in before if not k.startswith("input.")), \
            "every parameter moved"
        # a resent member update is a duplicate, not a new half-step
        seen = len(c.acks)
        await c.publish(c.topics.grad("m-a", "b"), member_update("b", 1, 1, 0))
        again = await c.until("the resend's ack", lambda: next(
            (a for a in c.acks[seen:] if (a.device, a.seq) == ("b", 1)), None))
        assert again.status == "duplicate"
        assert ps.version == 1


async def test_ps_discards_an_incomplete_or_overlapping_cluster_step(mosquitto_broker: BrokerProcess,
                                                                     tmp_path: Path) -> None:
    cfg = ps_config(mosquitto_broker, tmp_path, **{"ps.mesh_assembly_timeout_s": "0.3"})
    ps = ParameterServer(cfg)
    async with running(ps), devices(cfg, ["a", "b"]) as c:
        await c.publish(c.topics.plan(), mesh_plan(["a", "b"], SPLIT), retain=True)
        await c.version_at_least(0)
        await c.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 1, 0, step=7))
        # it times out with no other arrival to sweep it out
        ack = await c.ack_for("a", 1)
        assert (ack.status, ack.reason, ack.resync) == ("discarded", "incomplete", True)
        assert ps.metrics.value("edgemesh_ps_mesh_assembling_steps") == 0
        # a resend of a's part is told the same, and opens no new step
        seen = len(c.acks)
        await c.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 1, 0, step=7))
        again = await c.until("the resend's ack", lambda: next(
            (a for a in c.acks[seen:] if (a.device, a.seq) == ("a", 1)), None))
        assert (again.status, again.reason) == ("discarded", "incomplete")
        assert ps.metrics.value("edgemesh_ps_mesh_assembling_steps") == 0
        # two members claiming the same rows: both told, nothing applied
        await c.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 2, 0, step=9))
        overlap = await c.push(member_update("b", 0, 2, 0, step=9))
        assert (overlap.status, overlap.reason) == ("discarded", "shape")
        assert ps.version == 0
        assert ps.metrics.value("edgemesh_ps_rejected_total", reason="incomplete") >= 1


async def test_ps_discards_the_steps_of_a_replaced_plan_at_once(broker: BrokerProcess, tmp_path: Path) -> None:
    # members abandon a step when the plan changes: the PS must not hold the others' parts for
    # the whole assembly timeout (far longer than this test waits for an ack)
    cfg = ps_config(broker, tmp_path, **{"ps.mesh_assembly_timeout_s": "600"})
    ps = ParameterServer(cfg)
    async with running(ps), devices(cfg, ["a", "b"]) as c:
        await c.publish(c.topics.plan(), mesh_plan(["a", "b"], SPLIT), retain=True)
        await c.version_at_least(0)
        await c.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 1, 0, step=7))
        await c.until("a's shards held", lambda: ps.metrics.value("edgemesh_ps_mesh_assembling_steps") == 1)
        alone = replace(plan_for(["a", "b"], version=2), sync_policy="sync")
        await c.publish(c.topics.plan(), alone, retain=True)
        ack = await c.ack_for("a", 1)
        assert (ack.status, ack.reason, ack.resync) == ("discarded", "replanned", True)
        assert ps.metrics.value("edgemesh_ps_mesh_assembling_steps") == 0
        # b's part of that step, late: told at once too, nothing held
        late = await c.push(member_update("b", 1, 1, 0, step=7))
        assert (late.status, late.reason) == ("discarded", "replanned")
        assert ps.metrics.value("edgemesh_ps_mesh_assembling_steps") == 0
        # under the new plan both train alone, and the round is theirs
        acks = await asyncio.gather(c.push(gradient("a", 2, 0)), c.push(gradient("b", 2, 0)))
        assert [a.status for a in acks] == ["accepted", "accepted"] and ps.version == 1
        assert ps.metrics.value("edgemesh_ps_updates_total", status="discarded", reason="replanned") == 2


async def test_a_sync_round_lets_go_of_a_cluster_that_left_the_plan(broker: BrokerProcess, tmp_path: Path) -> None:
    # a's update waits in the round for b's cluster; then a new plan joins a and b in one mesh
    # cluster. The round must not wait for clusters the plan no longer has, nor keep a waiting for
    # an ack it would only get once it had trained under the new plan.
    cfg = ps_config(broker, tmp_path)
    ps = ParameterServer(cfg)

    def pending() -> float:
        return ps.metrics.value("edgemesh_ps_pending_updates")

    async with running(ps), devices(cfg, ["a", "b"]) as c:
        await c.publish(c.topics.plan(), replace(plan_for(["a", "b"]), sync_policy="sync"), retain=True)
        await c.version_at_least(0)
        await c.publish(c.topics.grad("c-a", "a"), replace(gradient("a", 1, 0), plan_version=1))
        await c.until("the round to hold a's update", lambda: pending() == 1)
        await c.publish(c.topics.plan(), mesh_plan(["a", "b"], SPLIT, version=2), retain=True)
        ack = await c.ack_for("a", 1)
        assert (ack.status, ack.reason, ack.resync) == ("discarded", "replanned", True)
        assert ps.version == 0 and pending() == 0
        # an update from the old cluster that arrives after the new plan is told the same
        old = await c.push(replace(gradient("b", 1, 0), plan_version=1))
        assert (old.status, old.reason) == ("discarded", "replanned")
        # the mesh cluster's step is the whole round now
        step = [replace(member_update(d, i, 2, 0, step=3), plan_version=2) for i, d in enumerate(["a", "b"])]
        acks = await asyncio.gather(c.push(step[0]), c.push(step[1]))
        assert [a.status for a in acks] == ["accepted", "accepted"] and ps.version == 1
        # an update computed under a plan the PS has not received yet is not from the past: it waits
        await c.publish(c.topics.grad("c-a", "a"), replace(gradient("a", 3, 1), plan_version=3))
        await c.until("the round to hold a's update", lambda: pending() == 1)
        await c.publish(c.topics.plan(), replace(plan_for(["a", "b"]), version=3, sync_policy="sync"),
                        retain=True)
        acks = await asyncio.gather(c.push(replace(gradient("b", 3, 1), plan_version=3)), c.ack_for("a", 3))
        assert [a.status for a in acks] == ["accepted", "accepted"] and ps.version == 2
