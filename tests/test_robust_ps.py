"""Robust aggregation in a parameter server on a real broker: ``set-aggregation`` switches the rule the next
step uses, the status reports it, a bad rule is refused, and a PS killed with -9 comes back with it;
and a quick run of ``edgemesh bench robust`` writes its report layout."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import WAIT_S, devices, gradient, make_config, serving_ps

from edgemesh.common.config import Config
from edgemesh.local.broker import BrokerProcess

JOB = "robust"
LEARNED = 0.3
"""Held-out accuracy the robust rule's quick run reaches at the least (digits has 10 classes: chance is 0.1)."""


def robust_config(broker: BrokerProcess, state_dir: Path) -> Config:
    # exact float32 snapshots after every step: the test reads how far the weights moved
    return make_config(broker, job=JOB, **{"ps.state_dir": state_dir, "ps.eval_every": 0, "ps.broadcast": "snapshot",
                                           "ps.snapshot_dtype": "float32", "training.sync_policy": "sync"})


def command(name: str, request_id: str, value: str | None = None) -> bytes:
    """A control command for the PS, as JSON, its reply to the tester."""
    return json.dumps({"command": name, "value": value, "requester": "tester", "request_id": request_id}).encode()


async def test_set_aggregation_switches_the_rule_the_next_round_uses(broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = robust_config(broker, tmp_path)
    cfg.ps.round_scaling = "none"  # one step of training.lr per round: the arithmetic below
    async with serving_ps(cfg, ["a", "b", "c"]) as (c, ps):
        ctl = c.topics.control("ps")
        await c.bus.publish(ctl, command("set-aggregation", "bad", "average"))
        refused = await c.reply("bad")
        assert not refused.ok and "aggregation must be one of mean, clip, median, trimmed-mean, krum" in refused.message
        assert ps.metrics.value("edgemesh_ps_rejected_total", route="control", reason="bad_command") == 1
        assert ps.aggregator.rule == "clip"  # the default, unchanged by the refused command
        await c.bus.publish(ctl, command("set-aggregation", "set", "median"))
        assert (await c.reply("set")).result["aggregation"] == "median"
        await c.bus.publish(ctl, command("status", "status"))
        assert (await c.reply("status")).result["aggregation"] == "median"

        start = await c.version_at_least(0)
        # a round of two honest updates and a wild one: the median takes an honest value, the mean would not
        for device, scale in (("a", 0.01), ("b", 0.01), ("c", 100.0)):
            await c.bus.publish(c.topics.grad(f"c-{device}", device), gradient(device, 1, 0, scale=scale))
        assert [(await c.ack_for(d, 1)).status for d in "abc"] == ["accepted"] * 3
        after = await c.version_at_least(1)
        moved = after.tensors["fc2.bias"].to_numpy() - start.tensors["fc2.bias"].to_numpy()
        # first step, momentum buffer empty: p -= lr x median x total weight (1)
        np.testing.assert_allclose(moved, -cfg.training.lr * 0.01, rtol=1e-3)


def ps_process(cfg: Config) -> subprocess.Popen[bytes]:
    """``edgemesh ps`` of ``cfg`` as a process of its own, to kill with -9."""
    return subprocess.Popen([sys.executable, "-m", "edgemesh", "ps", "--broker", cfg.broker.url, "--job", cfg.job,
                             "--state-dir", cfg.ps.state_dir, "--metrics", "127.0.0.1:0", "--policy", "sync",
                             "--set", "ps.eval_every=0", "--set", "broker.backoff_max_s=0.5"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


async def test_a_ps_killed_with_9_keeps_the_rule_set_by_the_operator(mosquitto_broker: BrokerProcess,
                                                                     tmp_path: Path) -> None:
    """``set-aggregation`` writes a checkpoint at once, and a restarted PS reads the rule back from it."""
    cfg = robust_config(mosquitto_broker, tmp_path / "ps")
    procs = [ps_process(cfg)]
    try:
        async with devices(cfg, ["a"]) as c:
            await c.publish_plan(["a"])
            await c.version_at_least(0)
            ctl = c.topics.control("ps")
            await c.bus.publish(ctl, command("set-aggregation", "set", "krum"))
            assert (await c.reply("set")).ok
            procs[0].send_signal(signal.SIGKILL)
            await asyncio.to_thread(procs[0].wait, WAIT_S)
            c.forget()
            procs.append(ps_process(cfg))
            await c.version_at_least(0)  # the restarted PS's snapshot: it is subscribed
            await c.bus.publish(ctl, command("status", "after"))
            assert (await c.reply("after")).result["aggregation"] == "krum"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=WAIT_S)


@pytest.mark.timeout(400)  # a cluster of processes per rule: slower than the default limit on a loaded host
def test_bench_robust_report_layout(tmp_path: Path) -> None:
    """A quick run: three workers, one flipping its gradient's sign; clean, then the mean and the median
    attacked. Layout and that training learns; no speed."""
    report = tmp_path / "robust.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "robust", "--report", str(report), "--workers", "3",
         "--attacks", "sign-flip", "--rules", "median", "--versions", "30"],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["workers"] == 3 and data["versions"] == 30 and data["settings"]["ps_shards"] == 1
    assert data["attackers"] == [{"device": "pi5-0", "attack": "sign-flip", "scale": 10.0}]
    assert set(data["attacked"]) == {"mean", "median"}
    for entry in [data["clean"], *data["attacked"].values()]:
        assert {"final_accuracy", "best_accuracy", "model_versions", "curve", "robust_clipped", "robust_excluded",
                "failure"} <= entry.keys()
        assert entry["failure"] is None and entry["reached_versions"]
        assert [v for _, v, _ in entry["curve"]] == [9, 19, 29]  # every run evaluated at the same versions
    assert data["clean"]["best_accuracy"] >= LEARNED and data["attacked"]["median"]["best_accuracy"] >= LEARNED
    # the mean follows the attacker up the loss: it never learns what the median does
    assert data["attacked"]["mean"]["best_accuracy"] < data["attacked"]["median"]["best_accuracy"]
    assert data["verdict"]["best_robust_rule"] == "median"
    assert report.with_suffix(".png").stat().st_size > 1000
