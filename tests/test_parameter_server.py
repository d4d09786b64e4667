"""Parameter server against real brokers: policies, acks, rejections, reconnects, crash recovery."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import WAIT_S, devices, gradient, make_config, running, serving_ps

from edgemesh.common import wire
from edgemesh.common.codecs import get_codec
from edgemesh.common.config import Config
from edgemesh.common.messages import (
    CodecPolicy,
    ControlReply,
    GradientUpdate,
    ModelSnapshot,
    ShardUpdate,
    SnapshotRequest,
    UpdateAck,
)
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.parameter_server.ledger import Entry, read_ledger
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.parameter_server.store import read_checkpoint, read_wal

JOB = "pstest"


def ps_config(broker: BrokerProcess, state_dir: Path, **settings: object) -> Config:
    # a snapshot per version: these tests read the model the PS publishes after every step
    return make_config(broker, job=JOB, **{"ps.state_dir": state_dir, "ps.eval_every": 0,
                                           "ps.broadcast": "snapshot", **settings})


async def test_async_applies_each_update_and_acks_it(broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "async", "training.staleness_bound": "4"})
    async with serving_ps(cfg, ["a", "b"]) as (c, ps):
        start = await c.version_at_least(0)
        ack = await c.push(gradient("a", 1, start.version))
        assert (ack.status, ack.version) == ("accepted", 1)
        ack = await c.push(gradient("b", 1, start.version))
        assert ack.status == "accepted" and ack.delay == 1
        snap = await c.version_at_least(2)
        assert snap.tensors["fc2.bias"].dtype == "float16"  # the default precision sent to workers
        # two updates, each applied once: the weights moved away from the initial model
        moved = snap.tensors["fc2.bias"].to_numpy() - start.tensors["fc2.bias"].to_numpy()
        assert np.all(moved < 0)
        assert ps.metrics.value("edgemesh_ps_updates_total", status="accepted", reason="") == 2
        assert ps.guard.chance == pytest.approx(0.1)  # digits' ten classes: a fall back to chance is judged


async def test_while_no_plan_names_a_device_the_model_goes_out_only_when_one_does(broker: BrokerProcess,
                                                                                  tmp_path: Path) -> None:
    """No one listens before the first plan: updates are applied and acked, nothing is encoded or published; the
    plan that names devices brings a snapshot of the model as it stands."""
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "async", "training.staleness_bound": "4"})
    ps = ParameterServer(cfg)
    async with devices(cfg, ["a"]) as c, running(ps):
        start = await c.version_at_least(0)  # the retained snapshot every connect brings
        for seq in (1, 2):
            assert (await c.push(gradient("a", seq, seq - 1))).status == "accepted"
        assert ps.version == 2 and ps.broadcast.skipped
        assert [s.version for s in c.snapshots] == [start.version]  # the steps went out as nothing
        await c.publish_plan(["a"])
        assert (await c.version_at_least(2)).version == 2


async def test_stale_update_is_discarded_and_acked_with_its_reason(broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "async", "training.staleness_bound": "1"})
    async with serving_ps(cfg, ["a"]) as (c, ps):
        for seq in (1, 2, 3):
            assert (await c.push(gradient("a", seq, seq - 1))).status == "accepted"
        ack = await c.push(gradient("a", 4, 1))  # delay 3 > bound 1
        assert (ack.status, ack.reason, ack.delay, ack.resync) == ("discarded", "stale", 2, True)
        assert ps.version == 3
        assert ps.metrics.value("edgemesh_ps_updates_total", status="discarded", reason="stale") == 1


async def test_sync_round_waits_for_every_cluster(broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "sync"})
    async with serving_ps(cfg, ["a", "b"]) as (c, ps):
        await c.bus.publish(c.topics.grad("c-a", "a"), gradient("a", 1, 0))
        await c.until("the PS to hold a's update", lambda: ps.metrics.value("edgemesh_ps_pending_updates") == 1)
        assert ps.version == 0 and not c.acks  # the round is open: nothing applied or acked
        ack_b = await c.push(gradient("b", 1, 0))
        ack_a = await c.ack_for("a", 1)
        assert ack_a.status == ack_b.status == "accepted" and ps.version == 1
        # an update computed on the previous round is stale under BSP
        ack = await c.push(gradient("a", 2, 0))
        assert (ack.status, ack.reason) == ("discarded", "stale")


async def test_duplicate_is_not_applied_twice(broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "async"})
    async with serving_ps(cfg, ["a"]) as (c, ps):
        update = gradient("a", 1, 0)
        assert (await c.push(update)).status == "accepted"
        c.forget()
        assert (await c.push(update)).status == "duplicate"
        assert ps.version == 1


@pytest.mark.parametrize("case", ["wrong_shape", "unknown_param", "nan", "truncated_codec", "truncated_grid",
                                  "inconsistent_grid", "unknown_device"])
async def test_bad_updates_are_rejected_counted_and_acked(broker: BrokerProcess, tmp_path: Path, case: str) -> None:
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "async"})
    async with serving_ps(cfg, ["a", "ghost"]) as (c, ps):
        good = gradient("a", 1, 0)
        shards = list(good.shards)
        device, reason = "a", {"wrong_shape": "shape", "unknown_param": "shape", "nan": "nan",
                               "truncated_codec": "codec", "truncated_grid": "codec", "inconsistent_grid": "codec",
                               "unknown_device": "unknown_device"}[case]
        if case == "wrong_shape":
            shards[0] = ShardUpdate(param=shards[0].param, start=0, stop=999, codec="none", data=shards[0].data)
        elif case == "unknown_param":
            shards[0] = ShardUpdate(param="nope.weight", start=0, stop=1, codec="none", data=b"\0" * 4)
        elif case == "nan":
            values = np.zeros(len(shards[0].data) // 4, np.float32)
            values[3] = np.nan
            shards[0] = ShardUpdate(param=shards[0].param, start=0, stop=shards[0].stop, codec="none",
                                    data=values.tobytes())
        elif case == "truncated_codec":
            shards[0] = ShardUpdate(param=shards[0].param, start=0, stop=shards[0].stop, codec="fp16",
                                    data=shards[0].data[:10])
        elif case in ("truncated_grid", "inconsistent_grid"):
            numel = len(shards[2].data) // 4
            grid = get_codec("grid").encode(np.random.default_rng(0).standard_normal(numel, dtype=np.float32),
                                            CodecPolicy(device="a", codec="grid", density=0.05))
            # cut the payload short, or give it to a parameter of another size
            data, index = (grid[: len(grid) // 2], 2) if case == "truncated_grid" else (grid, 0)
            shards[index] = ShardUpdate(param=shards[index].param, start=0, stop=shards[index].stop, codec="grid",
                                        data=data)
        else:
            device = "ghost"
        bad = GradientUpdate(device=device, cluster=f"c-{device}", incarnation=1, seq=1, base_version=0,
                             samples=8, shards=tuple(shards))
        ack = await c.push(bad)
        assert (ack.status, ack.reason) == ("discarded", reason)
        assert ps.metrics.value("edgemesh_ps_rejected_total", route="grad", reason=reason) == 1
        assert ps.version == 0
        # the service keeps working
        assert (await c.push(gradient("a", 2, 0))).status == "accepted"


@pytest.mark.requires_binary("mosquitto_pub")
async def test_malformed_and_oversized_payloads_are_counted(mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = ps_config(mosquitto_broker, tmp_path, **{"training.sync_policy": "async",
                                                     "broker.max_message_bytes": str(1 << 20)})
    async with serving_ps(cfg, ["a"]) as (c, ps):
        grad_topic = c.topics.grad("c-a", "a")
        # a plain mosquitto_pub, as an operator or an attacker would send it
        subprocess.run(["mosquitto_pub", "-h", mosquitto_broker.host, "-p", str(mosquitto_broker.port),
                        "-t", grad_topic, "-m", "not msgpack at all"], check=True, timeout=WAIT_S)
        big = tmp_path / "big.bin"
        big.write_bytes(b"\x00" * (2 << 20))
        subprocess.run(["mosquitto_pub", "-h", mosquitto_broker.host, "-p", str(mosquitto_broker.port),
                        "-t", grad_topic, "-f", str(big)], check=True, timeout=WAIT_S)
        await c.bus.publish(grad_topic, b"\x00" * (2 << 20))  # chunked by our bus: counted once
        await c.bus.publish(grad_topic, wire.pack("gradient", {"device": "a"}))  # missing fields
        await c.until("four rejections", lambda: sum(
            ps.metrics.value("edgemesh_ps_rejected_total", reason=r) for r in ("malformed", "oversized", "field")
        ) >= 4)
        assert ps.metrics.value("edgemesh_ps_rejected_total", reason="malformed") == 1
        assert ps.metrics.value("edgemesh_ps_rejected_total", reason="oversized") == 2
        assert ps.metrics.value("edgemesh_ps_rejected_total", reason="field") == 1
        assert (await c.push(gradient("a", 1, 0))).status == "accepted"


async def test_ps_reconnects_after_the_broker_is_killed(broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "async"})
    ps = ParameterServer(cfg)
    async with running(ps):
        async with devices(cfg, ["a"]) as c:
            await c.publish_plan(["a"])
            await c.version_at_least(0)
            assert (await c.push(gradient("a", 1, 0))).status == "accepted"
        broker.kill()
        broker.restart()  # retained plan and model are gone with the broker's memory
        async with devices(cfg, ["a"]) as c:
            await c.publish_plan(["a"])
            await c.until("the PS to reconnect", lambda: ps.metrics.value("edgemesh_ps_broker_connects_total") >= 2)
            # re-subscribed: a new update is applied and acked
            assert (await c.push(gradient("a", 2, 1))).status == "accepted"
            assert ps.version == 2


async def test_control_switches_policy_and_rejects_bad_commands(broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "sync"})
    async with serving_ps(cfg, ["a"]) as (c, ps):
        ctl = c.topics.control("ps")
        await c.bus.publish(ctl, b'{"command": "set-sync-policy", "value": "async", "requester": "tester",'
                                 b' "request_id": "r1"}')
        reply = await c.reply("r1")
        assert reply.ok and reply.result["policy"] == "async" and ps.policy == "async"
        await c.bus.publish(ctl, b'{"command": "set-bound", "value": -3, "requester": "tester", "request_id": "r2"}')
        reply = await c.reply("r2")
        assert not reply.ok and ps.bound == cfg.training.staleness_bound
        assert ps.metrics.value("edgemesh_ps_rejected_total", route="control", reason="bad_command") == 1
        await c.bus.publish(ctl, b'{"command": "pause", "requester": "tester", "request_id": "r3",'
                                 b' "expires_at": 1.0}')
        await c.until("expired command counted",
                      lambda: ps.metrics.value("edgemesh_ps_rejected_total", route="control", reason="expired") == 1)
        assert not ps.paused


# --------------------------------------------------------------------------- crash recovery


def start_ps_process(config: Config, policy: str = "async") -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "edgemesh", "ps", "--broker", config.broker.url, "--job", config.job,
         "--state-dir", config.ps.state_dir, "--metrics", "127.0.0.1:0",
         "--set", f"training.sync_policy={policy}", "--set", "ps.eval_every=0",
         "--set", "ps.checkpoint_every=3", "--set", "broker.backoff_max_s=0.5",
         # exact weights in every snapshot, to compare before and after the crash
         "--set", "ps.snapshot_dtype=float32", "--set", "ps.broadcast=snapshot"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


async def test_kill_9_and_restart_resumes_the_same_version_without_reapplying(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = ps_config(mosquitto_broker, tmp_path / "ps", **{"training.sync_policy": "async"})
    proc = start_ps_process(cfg)
    try:
        async with devices(cfg, ["a"]) as c:
            await c.publish_plan(["a"])
            await c.version_at_least(0)
            # 5 updates: a checkpoint at version 3, versions 4-5 only in the write-ahead log
            for seq in range(1, 6):
                assert (await c.push(gradient("a", seq, seq - 1, scale=0.01 * seq))).status == "accepted"
            before = await c.version_at_least(5)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=WAIT_S)
            assert (tmp_path / "ps" / "checkpoint.msgpack").exists()
            c.forget()
            proc = start_ps_process(cfg)
            after = await c.version_at_least(0)
            assert after.version == 5
            for name, tensor in before.tensors.items():
                assert np.array_equal(tensor.to_numpy(), after.tensors[name].to_numpy()), name
            # the worker resends what it could not see acked: nothing is applied twice
            c.forget()
            for seq in (4, 5):
                assert (await c.push(gradient("a", seq, seq - 1, scale=0.01 * seq))).status == "duplicate"
            assert (await c.push(gradient("a", 6, 5))).version == 6
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=WAIT_S)
    # the ledger: every applied update once, in order, across the crash
    assert read_ledger(tmp_path / "ps" / "ledger.log") == [Entry(v, "a", 1, v) for v in range(1, 7)]


async def test_kill_9_under_sync_replays_the_logged_round_sums_exactly(mosquitto_broker: BrokerProcess,
                                                                     tmp_path: Path) -> None:
    """A ``sync`` round of two dense updates is logged as its weighted sum (half their bytes); after kill -9 the
    replay of those sums gives the same weights bit for bit, and the resends are duplicates."""
    cfg = ps_config(mosquitto_broker, tmp_path / "ps", **{"training.sync_policy": "sync"})
    proc = start_ps_process(cfg, "sync")
    try:
        async with devices(cfg, ["a", "b"]) as c:
            await c.publish_plan(["a", "b"])
            await c.version_at_least(0)
            for seq in range(1, 6):  # a checkpoint at version 3, rounds 4-5 only in the write-ahead log
                acks = await asyncio.gather(c.push(gradient("a", seq, seq - 1, scale=0.01 * seq)),
                                            c.push(gradient("b", seq, seq - 1, scale=-0.003 * seq)))
                assert [a.status for a in acks] == ["accepted", "accepted"]
            before = await c.version_at_least(5)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=WAIT_S)
            logged = read_wal(tmp_path / "ps")
            assert [r["version"] for r in logged] == [4, 5]
            assert all("sum" in r and len(r["entries"]) == 2 and "shards" not in r["entries"][0] for r in logged)
            c.forget()
            proc = start_ps_process(cfg, "sync")
            after = await c.version_at_least(0)
            assert after.version == 5
            for name, tensor in before.tensors.items():
                assert np.array_equal(tensor.to_numpy(), after.tensors[name].to_numpy()), name
            c.forget()
            for device in ("a", "b"):
                assert (await c.push(gradient(device, 5, 4))).status == "duplicate"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=WAIT_S)
    assert sorted((e.version, e.device) for e in read_ledger(tmp_path / "ps" / "ledger.log")) == [
        (v, d) for v in range(1, 6) for d in ("a", "b")]


@pytest.mark.parametrize("stuck", [False, True], ids=["all-confirmed", "one-never"])
async def test_a_stopping_ps_waits_briefly_for_acks_in_flight_then_writes_its_checkpoint(
        mosquitto_broker: BrokerProcess, tmp_path: Path, stuck: bool) -> None:
    """Acks go out without the step loop waiting for their PUBACKs; a server that stops gives those still on
    their way up to ``acks.DRAIN_S`` (all confirmed in time, or one never), then checkpoints."""
    cfg = ps_config(mosquitto_broker, tmp_path, **{"training.sync_policy": "async"})
    async with serving_ps(cfg, ["a"]) as (c, ps):
        assert (await c.push(gradient("a", 1, 0))).status == "accepted"
        acks = [asyncio.create_task(asyncio.sleep(0.1))]  # acks the broker has not confirmed yet
        if stuck:
            acks.append(asyncio.create_task(asyncio.sleep(3600)))
        ps.acks.in_flight.update(acks)
    assert acks[0].done() and not acks[0].cancelled()
    assert all(a.cancelled() for a in acks[1:])
    snap = read_checkpoint(tmp_path)
    assert snap is not None and snap.version == 1


async def test_acks_go_out_in_the_order_of_their_batches(broker: BrokerProcess, tmp_path: Path) -> None:
    """A batch's acks wait for the previous batch's: when one ack's publish is held up (a broker outage makes it
    retry), a later batch's ack does not overtake it, and the versions acks name never go back."""
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "async", "training.staleness_bound": "8"})
    async with serving_ps(cfg, ["a", "b"]) as (c, ps):
        assert ps.bus is not None
        held, release = asyncio.Event(), asyncio.Event()
        publish, asked = ps.bus.publish, []

        async def slow_first_ack(topic: str, msg: object, **kwargs: Any) -> int:
            if isinstance(msg, UpdateAck):
                asked.append(msg.device)
                if msg.device == "a" and not release.is_set():
                    held.set()
                    await release.wait()
            return await publish(topic, msg, **kwargs)

        ps.bus.publish = slow_first_ack  # type: ignore[method-assign]
        first, second = gradient("a", 1, 0), gradient("b", 1, 0)
        await c.publish(c.topics.grad(first.cluster, "a"), first)
        await asyncio.wait_for(held.wait(), WAIT_S)
        await c.publish(c.topics.grad(second.cluster, "b"), second)
        await c.version_at_least(2)  # b's batch applied and published: with its ack sent at once, it would be asked
        assert asked == ["a"]
        release.set()
        await c.ack_for("b", 1)
        acks = [(a.device, a.version) for a in c.acks]
        assert acks == [("a", 1), ("b", 2)]


async def test_a_restarted_ps_keeps_the_operators_settings(mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """set-lr, set-bound, set-sync-policy and pause survive a kill -9 (they were lost before: the checkpoint
    kept them, nothing read them back, and nothing wrote them before the next periodic checkpoint)."""
    cfg = ps_config(mosquitto_broker, tmp_path / "ps", **{"training.sync_policy": "async"})
    proc = start_ps_process(cfg)
    try:
        async with devices(cfg, ["a"]) as c:
            await c.publish_plan(["a"])
            await c.version_at_least(0)
            ctl = c.topics.control("ps")
            for i, body in enumerate((b'"command": "set-lr", "value": 0.025', b'"command": "set-bound", "value": 7',
                                      b'"command": "set-sync-policy", "value": "ssp"', b'"command": "pause"')):
                await c.bus.publish(ctl, b"{" + body + b', "requester": "tester", "request_id": "s%d"}' % i)
                assert (await c.reply(f"s{i}")).ok
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=WAIT_S)
            c.forget()
            proc = start_ps_process(cfg)
            await c.version_at_least(0)  # the restarted PS's snapshot: it is subscribed
            await c.bus.publish(ctl, b'{"command": "status", "requester": "tester", "request_id": "after"}')
            status = await c.reply("after")
        assert (status.result["lr"], status.result["bound"], status.result["policy"], status.result["paused"]) == (
            0.025, 7, "ssp", True)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=WAIT_S)


async def test_a_paused_ps_holds_one_copy_of_a_resent_update(broker: BrokerProcess, tmp_path: Path) -> None:
    """Resends to a paused server are not queued again (they were, decoded, without bound)."""
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "async"})
    async with serving_ps(cfg, ["a"]) as (c, ps):
        ctl = c.topics.control("ps")
        await c.bus.publish(ctl, b'{"command": "pause", "requester": "tester", "request_id": "p"}')
        assert (await c.reply("p")).ok
        update = gradient("a", 1, 0)
        for _ in range(5):  # the worker resends it every ack timeout
            await c.bus.publish(c.topics.grad("c-a", "a"), update)
        await c.until("four resends held back", lambda: ps.metrics.value(
            "edgemesh_ps_rejected_total", route="grad", reason="queued") == 4)
        assert ps.version == 0
        await c.bus.publish(ctl, b'{"command": "resume", "requester": "tester", "request_id": "r"}')
        assert (await c.reply("r")).ok
        assert (await c.ack_for("a", 1)).status == "accepted"
        await c.until("one version", lambda: ps.version == 1)
        assert ps.metrics.value("edgemesh_ps_updates_total", status="accepted") == 1


async def test_ssp_holds_a_cluster_too_far_ahead_until_the_slowest_catches_up(
        broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "ssp", "training.staleness_bound": "1"})
    async with serving_ps(cfg, ["a", "b"]) as (c, ps):
        assert (await c.push(gradient("a", 1, 0))).status == "accepted"
        assert (await c.push(gradient("a", 2, 1))).status == "accepted"  # a is 2 ahead of b: the next waits
        await c.bus.publish(c.topics.grad("c-a", "a"), gradient("a", 3, 2))
        await c.until("a's third update to be held", lambda: ps.metrics.value("edgemesh_ps_pending_updates") == 1)
        assert ps.version == 2 and not any(a.seq == 3 for a in c.acks)
        assert (await c.push(gradient("b", 1, 2))).status == "accepted"  # b catches up...
        held = await c.ack_for("a", 3)  # ...and releases a's update
        assert held.status == "accepted" and ps.version == 4


G = 0.01
"""Every value of the gradients of the operator-control test: with momentum and weight decay off, one update
moves every weight by exactly ``-lr * G``."""


def assert_moved(before: ModelSnapshot, after: ModelSnapshot, by: float) -> None:
    """Every weight of ``after`` is the weight of ``before`` plus ``by`` (the standardization's constants, buffers
    no gradient moves, stay)."""
    for name, tensor in before.tensors.items():
        if name.startswith("input."):
            assert after.tensors[name] == tensor, name
            continue
        moved = after.tensors[name].to_numpy() - tensor.to_numpy()
        np.testing.assert_allclose(moved, by, rtol=1e-3, atol=1e-7, err_msg=name)


async def test_pause_resume_and_set_lr_change_what_the_ps_applies(broker: BrokerProcess, tmp_path: Path) -> None:
    """The operator's commands on ``control/ps`` act on training, not only on the reply: while paused, updates are
    held (the version and the weights stay); resume applies them; set-lr changes the step each update makes."""
    cfg = ps_config(broker, tmp_path, **{
        "training.sync_policy": "async", "training.lr": "0.1", "training.momentum": "0",
        "training.weight_decay": "0", "ps.staleness_weighting": "false", "ps.snapshot_dtype": "float32",
        "training.batch_size": "8"})  # the updates' batch: each one step of training.lr
    async with serving_ps(cfg, ["a"]) as (c, ps):
        ctl = c.topics.control("ps")

        async def command(body: bytes, request_id: str) -> ControlReply:
            await c.bus.publish(ctl, b'{%s, "requester": "tester", "request_id": "%s"}' % (body, request_id.encode()))
            reply = await c.reply(request_id)
            assert reply.ok, reply.message
            return reply

        start = await c.version_at_least(0)
        assert (await c.push(gradient("a", 1, 0, scale=G))).version == 1
        first = await c.version_at_least(1)
        assert_moved(start, first, -0.1 * G)

        await command(b'"command": "pause"', "pause")
        for seq in (2, 3):
            await c.bus.publish(c.topics.grad("c-a", "a"), gradient("a", seq, 1, scale=G))
        await c.until("two updates held", lambda: ps.metrics.value("edgemesh_ps_pending_updates") == 2)
        held = await command(b'"command": "status"', "held")  # a round trip after both arrived: still held
        assert (held.result["version"], held.result["paused"]) == (1, True)
        assert ps.version == 1 and not any(a.seq > 1 for a in c.acks)
        assert max(s.version for s in c.snapshots) == 1

        await command(b'"command": "resume"', "resume")
        assert [(await c.ack_for("a", seq)).status for seq in (2, 3)] == ["accepted", "accepted"]
        resumed = await c.version_at_least(3)
        assert resumed.version == 3 and ps.metrics.value("edgemesh_ps_pending_updates") == 0
        assert_moved(first, resumed, -2 * 0.1 * G)  # both held updates, at the learning rate of the time

        reply = await command(b'"command": "set-lr", "value": 0.025', "lr")
        assert reply.result["lr"] == 0.025
        assert (await c.push(gradient("a", 4, 3, scale=G))).status == "accepted"
        slower = await c.version_at_least(4)
        assert_moved(resumed, slower, -0.025 * G)  # a quarter of the step, for the same gradient


async def test_a_device_asks_for_a_snapshot_on_its_own_topic(broker: BrokerProcess, tmp_path: Path) -> None:
    """A mesh member's request for the whole model travels on ``device/{id}/snapshot-request``, which a
    broker ACL lets a device write (it went to ``control/ps`` before, which only the operator may write)."""
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "async", "ps.broadcast": "delta",
                                         "ps.snapshot_every": "1000"})
    async with serving_ps(cfg, ["a", "b", "ghost"]) as (c, ps):
        start = await c.version_at_least(0)
        await c.push(gradient("a", 1, start.version))  # version 1 goes out as a delta only
        await c.until("version 1", lambda: ps.version == 1)
        await c.publish(c.topics.snapshot_request("ghost"), SnapshotRequest(device="ghost", version=0))
        await c.until("the stranger's request refused", lambda: ps.metrics.value(
            "edgemesh_ps_rejected_total", route="snapshot_request", reason="unknown_device") == 1)
        assert max(s.version for s in c.snapshots) == 0
        await c.publish(c.topics.snapshot_request("b"), SnapshotRequest(device="b", version=0))
        assert (await c.version_at_least(1)).version == 1  # a whole snapshot of the current version


async def test_a_resend_while_its_sync_round_is_open_waits_for_the_round(broker: BrokerProcess,
                                                                        tmp_path: Path) -> None:
    """A round that lasts longer than the worker's ack timeout: its resend is held, not answered ``round_full``
    with a resync (the healthy device's work was thrown away, and its first copy applied later all the same)."""
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "sync"})
    async with serving_ps(cfg, ["a", "b"]) as (c, ps):
        start = await c.version_at_least(0)
        first = gradient("a", 1, start.version)
        await c.bus.publish(c.topics.grad("c-a", "a"), first)
        await c.until("a's update in the open round", lambda: ps.metrics.value("edgemesh_ps_pending_updates") == 1)
        await c.bus.publish(c.topics.grad("c-a", "a"), first)  # the worker's ack timed out: it resends
        await c.until("the resend held", lambda: ps.metrics.value(
            "edgemesh_ps_rejected_total", route="grad", reason="queued") == 1)
        assert not c.acks
        await c.push(gradient("b", 1, start.version))  # the round completes
        ack = await c.ack_for("a", 1)
        assert (ack.status, ack.version) == ("accepted", 1)
        assert [a.status for a in c.acks if a.device == "a"] == ["accepted"]  # one answer, the right one
