"""The parameter server's state: the SGD step by shard and durable state (checkpoint, write-ahead log)."""

from __future__ import annotations

import copy
import struct
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from edgemesh.common import models
from edgemesh.common.codecs import get_codec
from edgemesh.common.errors import CheckpointError, WireError
from edgemesh.common.messages import GradientUpdate, ShardUpdate
from edgemesh.services.parameter_server import store
from edgemesh.services.parameter_server.optimizer import MAX_RUNS, ModelState, ShardGrad
from edgemesh.services.parameter_server.recovery import Optimizer, Recovery
from edgemesh.services.parameter_server.robust import Combined
from edgemesh.services.parameter_server.scheduler import Candidate, Clock, Step, buffer_mean

# --------------------------------------------------------------------------- optimizer


def _params() -> dict[str, np.ndarray]:
    return {"w": np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "b": np.array([0.5, -0.5], dtype=np.float32)}


def test_model_state_copies_its_inputs() -> None:
    params = _params()
    state = ModelState(params)
    state.params["w"][0, 0] = 99.0
    assert params["w"][0, 0] == 0.0
    assert all(np.array_equal(state.momentum[k], np.zeros_like(v)) for k, v in params.items())


def test_step_is_sgd_with_momentum_on_the_weighted_gradient_sum() -> None:
    params = _params()
    state = ModelState(params)
    lr, mu, wd = 0.1, 0.9, 0.01
    g1 = np.full((4, 3), 1.0, dtype=np.float32)
    g2 = np.arange(12, dtype=np.float32).reshape(4, 3)
    gb = np.array([2.0, -4.0], dtype=np.float32)
    contributions = [(0.75, [ShardGrad("w", 0, 4, g1), ShardGrad("b", 0, 2, gb)]), (0.25, [ShardGrad("w", 0, 4, g2)])]

    state.step(contributions, lr=lr, momentum=mu, weight_decay=wd)
    # by hand: g = sum w_i g_i + wd * p;  buf = mu * buf + g;  p -= lr * buf
    g_w = 0.75 * g1 + 0.25 * g2 + wd * params["w"]
    g_b = 0.75 * gb + wd * params["b"]
    np.testing.assert_allclose(state.momentum["w"], g_w, rtol=1e-6)
    np.testing.assert_allclose(state.params["w"], params["w"] - lr * g_w, rtol=1e-6)
    np.testing.assert_allclose(state.params["b"], params["b"] - lr * g_b, rtol=1e-6)

    # second step: the momentum carries over
    p1, buf1 = state.params["w"].copy(), state.momentum["w"].copy()
    state.step([(1.0, [ShardGrad("w", 0, 4, g1)])], lr=lr, momentum=mu, weight_decay=wd)
    buf2 = mu * buf1 + g1 + wd * p1
    np.testing.assert_allclose(state.momentum["w"], buf2, rtol=1e-6)
    np.testing.assert_allclose(state.params["w"], p1 - lr * buf2, rtol=1e-6)
    assert state.params["w"].dtype == np.float32 and state.momentum["w"].dtype == np.float32


def test_a_lone_update_steps_on_its_decoded_buffer_without_changing_it() -> None:
    """An ``async`` update (one contribution, weight 1) is stepped on as decoded: a read-only view of the payload
    bytes, left as it was, and the step is the same as on a copy."""
    grad = np.arange(12, dtype=np.float32).reshape(4, 3) / 7
    payload = grad.tobytes()
    decoded = np.frombuffer(payload, dtype=np.float32).reshape(4, 3)  # as codec ``none`` decodes: read-only
    lone, copied = ModelState(_params()), ModelState(_params())
    for _ in range(3):  # momentum carries over, through the scratch room of ``lr * buf``
        summed = lone.step([(1.0, [ShardGrad("w", 0, 4, decoded)])], lr=0.1, momentum=0.9, weight_decay=0.01)
        copied.step([(1.0, [ShardGrad("w", 0, 4, grad.copy())])], lr=0.1, momentum=0.9, weight_decay=0.01)
    assert payload == grad.tobytes()
    assert np.array_equal(lone.params["w"], copied.params["w"])  # bit for bit
    assert np.array_equal(lone.momentum["w"], copied.momentum["w"])
    assert [(s.param, s.start, s.stop) for s in summed] == [("w", 0, 4)]


def test_a_sum_logged_while_it_is_applied_is_the_step_it_makes() -> None:
    """The parameter server sums a step's contributions, hands the sum to the log, and applies it meanwhile: the
    sum does not move the model, and applying it is ``step``, bit for bit, the sum unchanged by it."""
    g1 = np.arange(12, dtype=np.float32).reshape(4, 3) / 3
    g2 = np.full((2, 3), 0.5, dtype=np.float32)
    contributions = [(0.5, [ShardGrad("w", 0, 4, g1)]),
                     (0.5, [ShardGrad("w", 1, 3, g2), ShardGrad("b", 0, 2, g2[0, :2])])]
    split, whole = ModelState(_params()), ModelState(_params())
    summed = split.sum(contributions)
    assert all(np.array_equal(split.params[k], v) for k, v in _params().items())
    logged = [(g.param, g.start, g.stop, g.values.copy()) for g in summed.grads]
    split.apply(summed, lr=0.1, momentum=0.9, weight_decay=0.01)
    returned = whole.step(contributions, lr=0.1, momentum=0.9, weight_decay=0.01)
    assert all(np.array_equal(split.params[k], whole.params[k]) for k in split.params)
    assert [(g.param, g.start, g.stop) for g in returned] == [(p, a, b) for p, a, b, _ in logged]
    assert all(np.array_equal(g.values, v) for g, (_, _, _, v) in zip(summed.grads, logged, strict=True))


def test_a_lone_update_naming_rows_twice_adds_both_without_writing_to_its_buffer() -> None:
    whole = np.frombuffer(np.ones(12, dtype=np.float32).tobytes(), dtype=np.float32).reshape(4, 3)
    rows = np.full((2, 3), 2.0, dtype=np.float32)
    state = ModelState(_params())
    summed = state.step([(1.0, [ShardGrad("w", 0, 4, whole), ShardGrad("w", 1, 3, rows)])], lr=1.0, momentum=0.0)
    expected = np.ones((4, 3), dtype=np.float32)
    expected[1:3] += 2.0
    np.testing.assert_allclose(summed[0].values, expected)
    np.testing.assert_allclose(state.params["w"], _params()["w"] - expected, rtol=1e-6)
    assert np.array_equal(whole, np.ones((4, 3), dtype=np.float32))


def test_step_resumes_from_restored_momentum() -> None:
    params = _params()
    restored = {"w": np.ones((4, 3), dtype=np.float32), "b": np.ones(3, dtype=np.float32)}  # b: wrong shape
    state = ModelState(params, momentum=restored)
    assert np.array_equal(state.momentum["w"], restored["w"]) and np.array_equal(state.momentum["b"], np.zeros(2))
    g = np.zeros((4, 3), dtype=np.float32)
    state.step([(1.0, [ShardGrad("w", 0, 4, g)])], lr=0.5, momentum=0.5)
    np.testing.assert_allclose(state.params["w"], params["w"] - 0.5 * 0.5 * restored["w"], rtol=1e-6)


def test_a_slice_step_touches_only_its_rows() -> None:
    params = _params()
    state = ModelState(params)
    g = np.ones((2, 3), dtype=np.float32)
    state.step([(1.0, [ShardGrad("w", 1, 3, g)])], lr=0.1, momentum=0.9)
    np.testing.assert_allclose(state.params["w"][1:3], params["w"][1:3] - 0.1, rtol=1e-6)
    assert np.array_equal(state.params["w"][[0, 3]], params["w"][[0, 3]])
    assert np.array_equal(state.momentum["w"][[0, 3]], np.zeros((2, 3)))
    assert np.array_equal(state.params["b"], params["b"]) and not state.momentum["b"].any()


@pytest.mark.parametrize("every", [40, 2])  # a few runs of rows (stepped as slices), or scattered ones (gathered)
def test_a_step_on_some_rows_is_the_step_on_those_rows_alone(every: int) -> None:
    rows = 200
    rng = np.random.default_rng(every)
    params = {"w": rng.standard_normal((rows, 3)).astype(np.float32)}
    state = ModelState({k: v.copy() for k, v in params.items()})
    starts = range(0, rows, every)
    assert (len(starts) > MAX_RUNS) == (every == 2)
    grads = [ShardGrad("w", a, a + 1, rng.standard_normal((1, 3)).astype(np.float32)) for a in starts]
    buf = np.zeros((rows, 3), dtype=np.float32)
    for _ in range(2):  # momentum carries over
        state.step([(1.0, grads)], lr=0.1, momentum=0.9, weight_decay=0.01)
        for g in grads:  # the same arithmetic, row by row
            row = slice(g.start, g.stop)
            buf[row] = np.float32(0.9) * buf[row] + (g.values + np.float32(0.01) * params["w"][row])
            params["w"][row] -= np.float32(0.1) * buf[row]
    assert np.array_equal(state.params["w"], params["w"]) and np.array_equal(state.momentum["w"], buf)


def test_model_parallel_slices_of_one_step_equal_the_whole_tensor_step() -> None:
    whole, sliced = ModelState(_params()), ModelState(_params())
    g = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    for _ in range(3):
        whole.step([(1.0, [ShardGrad("w", 0, 4, g)])], lr=0.1, momentum=0.9, weight_decay=0.01)
        sliced.step([(1.0, [ShardGrad("w", 0, 1, g[0:1]), ShardGrad("w", 1, 4, g[1:4])])], lr=0.1, momentum=0.9,
                    weight_decay=0.01)
    np.testing.assert_allclose(sliced.params["w"], whole.params["w"], rtol=1e-6)
    np.testing.assert_allclose(sliced.momentum["w"], whole.momentum["w"], rtol=1e-6)


def test_one_step_mixing_whole_and_sliced_contributions_equals_the_whole_tensor_step() -> None:
    """A data-parallel cluster (whole tensor) and a model-parallel cluster (slices) in the same step."""
    g = np.ones((4, 3), dtype=np.float32)
    whole, mixed = ModelState(_params()), ModelState(_params())
    whole.step([(0.5, [ShardGrad("w", 0, 4, g)]), (0.5, [ShardGrad("w", 0, 4, g)])], lr=0.1, momentum=0.9)
    mixed.step([(0.5, [ShardGrad("w", 0, 4, g)]), (0.5, [ShardGrad("w", 0, 2, g[:2]), ShardGrad("w", 2, 4, g[2:])])],
               lr=0.1, momentum=0.9)
    np.testing.assert_allclose(mixed.params["w"], whole.params["w"], rtol=1e-6)
    np.testing.assert_allclose(mixed.momentum["w"], whole.momentum["w"], rtol=1e-6)


def test_slice_shape() -> None:
    state = ModelState({"conv.weight": np.zeros((8, 3, 3, 3), dtype=np.float32)})
    assert state.slice_shape("conv.weight", 0, 8) == (8, 3, 3, 3)
    assert state.slice_shape("conv.weight", 2, 5) == (3, 3, 3, 3)
    assert state.numel("conv.weight", 7, 8) == 27


@pytest.mark.parametrize("param,start,stop", [
    ("fc.weight", 0, 1), ("conv.weight", 0, 9), ("conv.weight", -1, 2), ("conv.weight", 3, 3), ("conv.weight", 5, 2),
    ("conv.weight", 8, 9),
])
def test_slice_shape_refuses_unknown_params_and_out_of_range_shards(param: str, start: int, stop: int) -> None:
    state = ModelState({"conv.weight": np.zeros((8, 3, 3, 3), dtype=np.float32)})
    with pytest.raises(WireError) as exc:
        state.slice_shape(param, start, stop)
    assert exc.value.reason == "shape"


# --------------------------------------------------------------------------- checkpoints


def _snapshot() -> store.Snapshot:
    rng = np.random.default_rng(1)
    return store.Snapshot(
        model_spec="digits-cnn", version=412,
        params={"w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.zeros(0, dtype=np.float32)},
        momentum={"w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.zeros(0, dtype=np.float32)},
        high_water={"pi-a": (2, 17), "pi-b": (0, 3)}, clocks={"c0": 200, "c1": 212},
        settings={"policy": "ssp", "bound": 4, "lr": 0.05, "paused": False})


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    snap = _snapshot()
    path = store.write_checkpoint(tmp_path / "ps", snap)
    assert path == tmp_path / "ps" / store.CHECKPOINT_NAME
    got = store.read_checkpoint(tmp_path / "ps")
    assert got is not None
    assert (got.model_spec, got.version, got.high_water, got.clocks, got.settings) == (
        snap.model_spec, snap.version, snap.high_water, snap.clocks, snap.settings)
    for name in ("w", "b"):
        assert got.params[name].dtype == np.float32 and np.array_equal(got.params[name], snap.params[name])
        assert np.array_equal(got.momentum[name], snap.momentum[name])
    got.params["w"][0, 0] = 1.0  # loaded arrays are writable (the PS steps on them)
    assert not list((tmp_path / "ps").glob("*.tmp"))


def _rewrite(path: Path, change: object) -> None:
    """The checkpoint at ``path`` with its body changed by ``change`` (given the unpacked body), checksum renewed."""
    body = msgpack.unpackb(path.read_bytes()[8:], raw=False)
    change(body)  # type: ignore[operator]
    data = msgpack.packb(body, use_bin_type=True)
    path.write_bytes(struct.pack("<II", len(data), zlib.crc32(data)) + data)


def test_a_checkpoint_names_each_devices_high_water_mark_and_reads_the_earlier_lists(tmp_path: Path) -> None:
    path = store.write_checkpoint(tmp_path, _snapshot())
    kept = msgpack.unpackb(path.read_bytes()[8:], raw=False)["high_water"]
    assert kept == {"pi-a": {"incarnation": 2, "seq": 17}, "pi-b": {"incarnation": 0, "seq": 3}}
    _rewrite(path, lambda body: body.update(high_water={"pi-a": [2, 17], "pi-b": [0, 3]}))  # as written before
    got = store.read_checkpoint(tmp_path)
    assert got is not None and got.high_water == {"pi-a": (2, 17), "pi-b": (0, 3)}
    for bad in ({"incarnation": 2}, [2], "x", 7):
        _rewrite(path, lambda body, bad=bad: body.update(high_water={"pi-a": bad}))
        with pytest.raises(CheckpointError):
            store.read_checkpoint(tmp_path)


def test_a_missing_checkpoint_reads_as_none(tmp_path: Path) -> None:
    assert store.read_checkpoint(tmp_path) is None


def test_a_new_checkpoint_replaces_the_old(tmp_path: Path) -> None:
    snap = _snapshot()
    store.write_checkpoint(tmp_path, snap)
    snap.version = 600
    store.write_checkpoint(tmp_path, snap)
    got = store.read_checkpoint(tmp_path)
    assert got is not None and got.version == 600


def test_a_corrupt_checkpoint_raises(tmp_path: Path) -> None:
    path = store.write_checkpoint(tmp_path, _snapshot())
    raw = path.read_bytes()
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x40
    for bad in (b"", raw[:3], raw[:-1], bytes(flipped)):
        path.write_bytes(bad)
        with pytest.raises(CheckpointError):
            store.read_checkpoint(tmp_path)


def test_a_checkpoint_of_another_format_raises(tmp_path: Path) -> None:
    body = msgpack.packb({"format": 99, "model_spec": "x"}, use_bin_type=True)
    (tmp_path / store.CHECKPOINT_NAME).write_bytes(struct.pack("<II", len(body), zlib.crc32(body)) + body)
    with pytest.raises(CheckpointError, match="format"):
        store.read_checkpoint(tmp_path)


# --------------------------------------------------------------------------- write-ahead log


def _records(n: int, start: int = 0) -> list[dict[str, object]]:
    return [{"version": v, "lr": 0.1, "entries": [{"device": "pi-a", "seq": v, "grad": b"\x00" * v}]}
            for v in range(start, start + n)]


def test_wal_append_and_read(tmp_path: Path) -> None:
    wal = store.WriteAheadLog(tmp_path, fsync=True)
    try:
        assert wal.append([]) == 0
        empty = wal.end
        written = wal.append(_records(3))
        assert written == wal.end - empty
        wal.append(_records(2, start=3))
    finally:
        wal.close()
    assert store.read_wal(tmp_path) == _records(5)


def test_a_syncing_log_is_written_ahead_with_zeros_that_no_read_takes_for_records(tmp_path: Path) -> None:
    """Records go where the file is already written (cheap to sync); the zeros past them end every read, and a
    reopened log appends after its last record, not after the zeros."""
    wal = store.WriteAheadLog(tmp_path, fsync=True)
    wal.append(_records(3))
    end = wal.end
    wal.close()
    path = tmp_path / store.WAL_NAME
    assert path.stat().st_size >= end + store.AHEAD_MIN_BYTES // 2
    assert path.read_bytes()[end:] == bytes(path.stat().st_size - end)
    assert store.read_wal(tmp_path) == _records(3)
    wal = store.WriteAheadLog(tmp_path, fsync=True)
    assert wal.end == end
    big = [{"version": 9, "grad": bytes(range(256)) * 8_000}]  # past the zeros: more are written first
    wal.append(big)
    wal.close()
    assert store.read_wal(tmp_path) == [*_records(3), *big]
    assert path.stat().st_size >= end + len(big[0]["grad"]) * store.AHEAD_RECORDS


def test_wal_of_a_fresh_directory_is_empty(tmp_path: Path) -> None:
    assert store.read_wal(tmp_path / "never-written") == []


def test_wal_reopened_appends_after_the_old_records(tmp_path: Path) -> None:
    for start in (0, 2):
        wal = store.WriteAheadLog(tmp_path, fsync=False)
        wal.append(_records(2, start=start))
        wal.close()
    assert store.read_wal(tmp_path) == _records(4)


@pytest.mark.parametrize("cut", [1, 4, 7, 8, 9], ids=lambda c: f"cut-{c}")
def test_a_torn_wal_tail_is_cut_and_earlier_records_kept(tmp_path: Path, cut: int) -> None:
    wal = store.WriteAheadLog(tmp_path, fsync=False)
    wal.append(_records(3))
    good_size = (tmp_path / store.WAL_NAME).stat().st_size
    wal.append(_records(1, start=3))
    wal.close()
    path = tmp_path / store.WAL_NAME
    full = path.read_bytes()
    path.write_bytes(full[: good_size + min(cut, len(full) - good_size - 1)])
    assert store.read_wal(tmp_path) == _records(3)
    # the log keeps working after the cut: the next record takes the torn one's place
    wal = store.WriteAheadLog(tmp_path, fsync=False)
    wal.append(_records(1, start=9))
    wal.close()
    assert store.read_wal(tmp_path) == [*_records(3), *_records(1, start=9)]


def test_a_corrupt_last_record_is_cut(tmp_path: Path) -> None:
    wal = store.WriteAheadLog(tmp_path, fsync=False)
    wal.append(_records(2))
    wal.append(_records(1, start=2))
    wal.close()
    path = tmp_path / store.WAL_NAME
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # checksum no longer matches
    path.write_bytes(bytes(raw))
    assert store.read_wal(tmp_path) == _records(2)
    wal = store.WriteAheadLog(tmp_path, fsync=False)
    wal.append(_records(1, start=5))
    wal.close()
    assert store.read_wal(tmp_path) == [*_records(2), *_records(1, start=5)]


def test_reset_empties_the_log_and_keeps_it_usable(tmp_path: Path) -> None:
    wal = store.WriteAheadLog(tmp_path, fsync=True)
    try:
        wal.append(_records(3))
        size = (tmp_path / store.WAL_NAME).stat().st_size
        wal.reset()
        assert store.read_wal(tmp_path) == []
        wal.append(_records(1, start=7))
    finally:
        wal.close()
    # the new generation overwrites the old one in the same file; the old records after it are not read back
    assert store.read_wal(tmp_path) == _records(1, start=7)
    assert (tmp_path / store.WAL_NAME).stat().st_size == size
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.WAL_NAME]
    wal = store.WriteAheadLog(tmp_path, fsync=False)  # reopened: the generation goes on after its last record
    wal.append(_records(1, start=8))
    wal.close()
    assert store.read_wal(tmp_path) == _records(2, start=7)


def test_a_log_of_the_earlier_format_is_read_and_rewritten(tmp_path: Path) -> None:
    """Before generations a log was records from the start of the file, checked with zlib's crc32."""
    path = tmp_path / store.WAL_NAME
    bodies = [msgpack.packb(r, use_bin_type=True) for r in _records(3)]
    path.write_bytes(b"".join(struct.pack("<II", len(b), zlib.crc32(b)) + b for b in bodies) + b"\x07\x00")
    assert store.read_wal(tmp_path) == _records(3)  # the torn tail ends it, as before
    wal = store.WriteAheadLog(tmp_path, fsync=True)
    wal.append(_records(1, start=3))
    wal.close()
    assert store.read_wal(tmp_path) == _records(4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.WAL_NAME]


def test_a_stale_length_is_not_read_into_memory(tmp_path: Path) -> None:
    wal = store.WriteAheadLog(tmp_path, fsync=False)
    wal.append(_records(2))
    wal.close()
    with open(tmp_path / store.WAL_NAME, "ab") as fh:
        fh.write(struct.pack("<II", 0xFFFFFFF0, 0) + b"\x00" * 64)
    assert store.read_wal(tmp_path) == _records(2)


def test_a_logged_record_is_the_msgpack_of_it_with_long_buffers_not_copied(tmp_path: Path) -> None:
    grad = np.arange(70_000, dtype=np.float32)
    record = {"version": 3, "lr": 0.1, "entries": [
        {"device": "pi-a", "shards": [{"param": "w", "start": 0, "stop": 2, "data": grad.tobytes()},
                                      {"param": "b", "start": 0, "stop": 1, "data": b"\x01" * (store._INLINE - 1)}]},
        {"device": "pi-b", "weight": 0.5, "shards": ()}],
        "sum": [{"param": "w", "data": grad.data}, {"param": "v", "data": bytearray(store._INLINE)}]}
    pieces = store._pieces(record)
    assert b"".join(pieces) == msgpack.packb(record, use_bin_type=True)
    assert sum(isinstance(p, memoryview) for p in pieces) == 3  # the two long gradients and the long bytearray
    wal = store.WriteAheadLog(tmp_path, fsync=True)
    wal.append([record, *_records(1, start=4)])
    wal.close()
    back = store.read_wal(tmp_path)
    assert back[0]["sum"][0]["data"] == grad.tobytes() and back[0]["entries"][1]["shards"] == []
    assert back[1:] == _records(1, start=4)


# --------------------------------------------------------------------------- buffers


def _with_buffers() -> dict[str, np.ndarray]:
    return {**_params(), "bn.running_mean": np.zeros(2, np.float32), "bn.running_var": np.ones(2, np.float32),
            "bn.num_batches_tracked": np.zeros(1, np.float32)}


BUFFERS = {"bn.running_mean": False, "bn.running_var": False, "bn.num_batches_tracked": True}
MOMENTA = {"bn.running_mean": 0.1, "bn.running_var": 0.1}


def test_a_step_adds_the_sample_weighted_mean_of_the_buffers_changes_without_lr_or_momentum() -> None:
    """Running statistics are not parameters: a step moves them by its updates' changes weighted by their samples
    (as one batch of all their samples would), whatever the gradients' weights; a counter stays a whole count."""
    state = ModelState(_with_buffers(), buffers=BUFFERS)
    grads = [ShardGrad("w", 0, 4, np.ones((4, 3), np.float32))]
    change = {  # two updates of 30 and 10 samples; each step adds 1 to the counter
        30: [ShardGrad("bn.running_mean", 0, 2, np.array([0.4, 0.0], np.float32)),
             ShardGrad("bn.num_batches_tracked", 0, 1, np.ones(1, np.float32))],
        10: [ShardGrad("bn.running_mean", 0, 2, np.array([0.0, 0.8], np.float32)),
             ShardGrad("bn.num_batches_tracked", 0, 1, np.ones(1, np.float32))],
    }
    moved = buffer_mean(list(change.items()))
    assert [w for w, _ in moved] == [0.75, 0.25]
    for _ in range(3):
        state.step([(0.1, grads), (0.9, grads)], lr=0.5, momentum=0.9, weight_decay=0.01, buffers=moved)
    np.testing.assert_allclose(state.params["bn.running_mean"], [3 * 0.3, 3 * 0.2], rtol=1e-6)
    np.testing.assert_array_equal(state.params["bn.running_var"], [1.0, 1.0])  # no change sent: none made
    assert state.params["bn.num_batches_tracked"].tolist() == [3.0]
    assert not state.momentum["bn.running_mean"].any()  # no momentum, no weight decay on a buffer
    assert buffer_mean([(5, [])]) == []  # an update that moved no buffer weighs nothing


def _bn_changes(bn: torch.nn.BatchNorm1d, batches: list[torch.Tensor]) -> list[tuple[int, list[ShardGrad]]]:
    """Each batch's change to ``bn``'s running statistics, every one from ``bn`` as it is (devices on one version)."""
    changes = []
    for x in batches:
        device = copy.deepcopy(bn).train()
        before = {k: v.clone() for k, v in device.state_dict().items()}
        device(x)
        changes.append((len(x), [ShardGrad(f"bn.{k}", 0, 2, (v - before[k]).numpy().reshape(2).astype(np.float32))
                                 for k, v in device.state_dict().items() if k.startswith("running")]))
    return changes


@pytest.mark.parametrize("devices", [2, 4, 10])
def test_a_round_moves_running_statistics_as_its_batches_would_in_one_process(devices: int) -> None:
    """A synchronous round of ``devices`` updates moves batch norm's running statistics as those batches, one after
    another, move them in one process: exactly when the batches have the same statistics, and far closer than their
    mean change alone when they differ (which would make the statistics trail the weights ``devices`` times as
    far)."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(2, momentum=0.1)
    momenta = models.buffer_momenta(bn)
    assert momenta == {"running_mean": 0.1, "running_var": 0.1}
    momenta = {f"bn.{k}": m for k, m in momenta.items()}
    start = {"bn.running_mean": np.zeros(2, np.float32), "bn.running_var": np.ones(2, np.float32)}
    kinds = {"bn.running_mean": False, "bn.running_var": False}
    same = [torch.randn(16, 2) * 3 + 5] * devices
    varied = [torch.randn(16, 2) * (1 + k) + k for k in range(devices)]
    for batches, close in ((same, 1e-5), (varied, None)):
        one = copy.deepcopy(bn).train()
        for x in batches:
            one(x)
        fleet, plain = (ModelState(start, buffers=kinds, momenta=momenta), ModelState(start, buffers=kinds))
        for state in (fleet, plain):
            state.step([], lr=0.1, momentum=0.9, buffers=buffer_mean(_bn_changes(bn, batches)))
        for stat in ("running_mean", "running_var"):
            want = getattr(one, stat).numpy()
            off, mean_off = (np.abs(s.params[f"bn.{stat}"] - want).max() for s in (fleet, plain))
            if close:
                assert off < close and mean_off > 0.5
            else:
                assert off < mean_off / 3


@pytest.mark.parametrize("rounds", ["sync", "async"])
def test_devices_whose_data_differ_leave_the_running_variance_of_their_pooled_data(rounds: str) -> None:
    """Two devices whose inputs are offset from each other (a camera brighter than another): each batch's variance is
    its own device's, about 1, while the pooled data's is about 10. The parameter server's running variance, moved
    by the workers' steps (``compute_update``) in rounds of both or one update at a time, is the pooled data's; the
    batches' own variances alone (``nn.BatchNorm``'s change) would leave it near 1. Devices holding the same data
    leave the variance of that data."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(2), torch.nn.Linear(2, 3))
    names = {name: f"bn.{name.split('.', 1)[1]}" for name in model.state_dict() if name.startswith("0.")}
    kinds, momenta = models.buffer_kinds(model), models.buffer_momenta(model)
    start = {names[k]: v.numpy().reshape(-1).astype(np.float32) for k, v in model.state_dict().items() if k in names}
    generator = np.random.default_rng(0)

    def trained(offsets: list[float]) -> np.ndarray:
        state = ModelState(start, buffers={names[k]: v for k, v in kinds.items()},
                           momenta={names[k]: m for k, m in momenta.items()})
        for turn in range(300):
            devices = offsets if rounds == "sync" else [offsets[turn % len(offsets)]]
            changes = []
            for offset in devices:
                models.set_params(model, {**{k: v.detach().numpy() for k, v in model.named_parameters()},
                                          **{k: state.params[names[k]].reshape(model.state_dict()[k].shape)
                                             for k in names}})
                x = (generator.standard_normal((32, 2)) + offset).astype(np.float32)
                update = models.compute_update(model, x, generator.integers(0, 3, 32))
                changes.append((32, [ShardGrad(names[k], 0, len(c), c) for k, c in update.buffers.items()
                                     if k in names]))
            state.step([], lr=0.1, momentum=0.9, buffers=buffer_mean(changes))
        return state.params["bn.running_var"]

    np.testing.assert_allclose(trained([-3.0, 3.0]), 10.0, rtol=0.25)
    np.testing.assert_allclose(trained([0.0, 0.0]), 1.0, rtol=0.25)


def test_gradients_and_buffer_changes_travel_apart_and_neither_may_stand_for_the_other() -> None:
    state = ModelState(_with_buffers(), buffers=BUFFERS)
    none = get_codec("none")
    grad = ShardUpdate(param="w", start=0, stop=4, codec="none", data=none.encode(np.ones(12, np.float32), None))
    change = ShardUpdate(param="bn.running_var", start=0, stop=2, codec="none",
                         data=none.encode(np.ones(2, np.float32), None))
    assert [g.param for g in state.decode([grad])] == ["w"]
    assert [g.param for g in state.decode([change], buffers=True)] == ["bn.running_var"]
    with pytest.raises(WireError, match="is a buffer of the model") as bad:
        state.decode([change])
    assert bad.value.reason == "shape"
    with pytest.raises(WireError, match="is not a buffer of the model"):
        state.decode([grad], buffers=True)


def test_a_replay_of_the_log_restores_the_buffers_as_the_steps_moved_them(tmp_path: Path) -> None:
    """The write-ahead log keeps each update's samples beside its shards: a PS replaying it after ``kill -9`` holds
    the running statistics the steps made, bit for bit, whether a record keeps the updates or their sum."""
    rng = np.random.default_rng(3)
    initial = _with_buffers()
    live = Recovery(tmp_path, fsync=False)
    state = live.resume("spec", initial, Clock(), buffers=BUFFERS, momenta=MOMENTA).state
    for version, count in enumerate([1, 3, 1, 2], start=1):  # a single update, then rounds of several
        items = []
        for k in range(count):
            shards = {name: ShardUpdate(param=name, start=0, stop=len(v), codec="none",
                                        data=rng.normal(size=v.shape).astype(np.float32).tobytes())
                      for name, v in initial.items() if name != "bn.num_batches_tracked"}
            update = GradientUpdate(device=f"d{k}", cluster=f"c{k}", incarnation=1, seq=version, base_version=0,
                                    samples=int(rng.integers(1, 50)),
                                    shards=tuple(u for name, u in shards.items() if name not in BUFFERS),
                                    buffers=tuple(u for name, u in shards.items() if name in BUFFERS))
            items.append(Candidate(update, state.decode(update.shards), 0.0,
                                   buffers=state.decode(update.buffers, buffers=True)))
        step = Step(tuple(items), version, tuple(1 / count for _ in items))
        summed = state.step(step.contributions(), lr=0.1, momentum=0.9, buffers=step.buffer_contributions())
        live.log([step], Optimizer(0.1, 0.9), [Combined(step.contributions())], [summed]).durable()
    live.close()
    assert not np.allclose(state.params["bn.running_mean"], 0)
    resumed = Recovery(tmp_path, fsync=False).resume("spec", initial, Clock(), buffers=BUFFERS, momenta=MOMENTA)
    assert resumed.replayed == 4
    for name in initial:
        np.testing.assert_array_equal(resumed.state.params[name], state.params[name])


def test_a_checkpoint_from_before_buffers_resumes_with_their_initial_values(tmp_path: Path) -> None:
    store.write_checkpoint(tmp_path, store.Snapshot(model_spec="spec", version=7, params=_params(),
                                                    momentum={k: np.zeros_like(v) for k, v in _params().items()}))
    clock = Clock()
    resumed = Recovery(tmp_path, fsync=False).resume("spec", _with_buffers(), clock, buffers=BUFFERS)
    assert clock.version == 7 and resumed.state.params["bn.running_var"].tolist() == [1.0, 1.0]
