"""The parameter server's ledger of applied updates: appended with every step, caught up with the write-ahead
log after a crash between the two, readable past a torn last line; and the log written beside the broadcast's
encoding, durable when the step returns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemesh.common.messages import GradientUpdate
from edgemesh.services.parameter_server.ledger import FILE, Entry, Ledger, read_ledger
from edgemesh.services.parameter_server.optimizer import ShardGrad
from edgemesh.services.parameter_server.recovery import Optimizer, Recovery
from edgemesh.services.parameter_server.robust import Aggregation, Combined
from edgemesh.services.parameter_server.scheduler import Candidate, Clock, Step


def step(version: int, *updates: tuple[str, int, int]) -> Step:
    items = tuple(Candidate(GradientUpdate(device=d, cluster=f"c-{d}", incarnation=i, seq=q, base_version=version - 1,
                                           samples=8, shards=()),
                            [ShardGrad("w", 0, 1, np.zeros((1,), np.float32))], 0.0) for d, i, q in updates)
    return Step(version=version, items=items, weights=tuple(1 / len(items) for _ in items))


def test_steps_are_recorded_in_order_and_read_back(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path, fsync=False)
    assert ledger.open() == 0
    assert ledger.record([step(1, ("a", 7, 1), ("b", 9, 1)), step(2, ("a", 7, 2))]) == 3
    ledger.close()
    assert read_ledger(tmp_path / FILE) == [Entry(1, "a", 7, 1), Entry(1, "b", 9, 1), Entry(2, "a", 7, 2)]


def test_a_step_logged_but_not_in_the_ledger_is_added_on_open(tmp_path: Path) -> None:
    """A crash after the write-ahead log took a step and before the ledger did: the step is applied on
    restart (the log is replayed), so the ledger must name it too, once."""
    recovery = Recovery(tmp_path, fsync=False)
    recovery.resume("digits-cnn", {"w": np.zeros((1,), np.float32)}, Clock())
    ledger = Ledger(tmp_path, fsync=False)
    ledger.open()
    first, second = step(1, ("a", 1, 1)), step(2, ("a", 1, 2), ("b", 1, 1))
    for s in (first, second):
        recovery.log([s], Optimizer(0.1, 0.0), [Combined([], how=Aggregation())], [[]]).durable()
    ledger.record([first])  # the crash: second never reached the ledger
    ledger.close()
    recovery.close()
    again = Ledger(tmp_path, fsync=False)
    assert again.open() == 2
    again.close()
    assert again.open() == 0  # and only once
    again.close()
    assert [e.key for e in read_ledger(tmp_path / FILE)] == [("a", 1, 1), ("a", 1, 2), ("b", 1, 1)]


def test_a_torn_last_line_is_not_an_entry(tmp_path: Path) -> None:
    (tmp_path / FILE).write_text("1 a 1 1\n2 a 1")
    assert read_ledger(tmp_path / FILE) == [Entry(1, "a", 1, 1)]
    ledger = Ledger(tmp_path, fsync=False)
    ledger.open()
    ledger.record([step(2, ("a", 1, 2))])
    ledger.close()
    assert read_ledger(tmp_path / FILE) == [Entry(1, "a", 1, 1), Entry(2, "a", 1, 2)]


def test_steps_logged_beside_the_encoding_are_durable_when_its_block_ends_even_if_the_encoding_fails(
        tmp_path: Path) -> None:
    """``Recovery.log``: the step is written in the log's own thread while the caller encodes the broadcast in the
    ``with`` block; the block's end waits until it is durable, and an encoding that raised still leaves its step
    logged (its acks may go)."""
    recovery = Recovery(tmp_path, fsync=True)
    recovery.resume("digits-cnn", {"w": np.zeros((1,), np.float32)}, Clock())
    combined = [Combined([], how=Aggregation())]
    with recovery.log([step(1, ("a", 1, 1))], Optimizer(0.1, 0.0), combined, [[]]) as logged:
        encoded = "encoded"
    assert logged.written > 0 and encoded == "encoded"
    with pytest.raises(RuntimeError, match="encoding failed"), \
            recovery.log([step(2, ("a", 1, 2))], Optimizer(0.1, 0.0), combined, [[]]):
        raise RuntimeError("encoding failed")
    recovery.close()
    clock = Clock()
    resumed = Recovery(tmp_path, fsync=False).resume("digits-cnn", {"w": np.zeros((1,), np.float32)}, clock)
    assert (resumed.replayed, clock.version) == (2, 2)
