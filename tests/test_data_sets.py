"""Tests for edgemesh.common.data's data sets: Dataset, load_dataset, digits, MNIST IDX, CIFAR-10, unpickling,
synthetic CIFAR."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers import label_distribution

from edgemesh.common.data import (
    DATASET_NAMES,
    SYNTHETIC_TEST,
    SYNTHETIC_TRAIN,
    Dataset,
    load_dataset,
    parse_idx,
    restricted_loads,
    synthetic_cifar,
)
from edgemesh.common.data import digits as digits_module
from edgemesh.common.errors import DataError, EdgeMeshError

# --------------------------------------------------------------------------- helpers


def _idx_bytes(array: np.ndarray, dtype_code: int = 0x08) -> bytes:
    header = bytes([0, 0, dtype_code, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def _write(path: Path, data: bytes, gz: bool) -> None:
    if gz:
        with gzip.open(path.with_name(path.name + ".gz"), "wb") as handle:
            handle.write(data)
    else:
        path.write_bytes(data)


def _write_mnist(
    directory: Path, n_train: int = 12, n_test: int = 5, gz: bool = False, seed: int = 1
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, size=(n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, size=n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, size=n_test, dtype=np.uint8),
    }
    for name, array in arrays.items():
        _write(directory / name, _idx_bytes(array), gz)
    return arrays


def _cifar_batch(n: int, seed: int) -> dict[bytes, object]:
    rng = np.random.default_rng(seed)
    return {
        b"batch_label": f"batch {seed}".encode(),
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        b"labels": [int(v) for v in rng.integers(0, 10, size=n)],
    }


def _write_cifar(directory: Path, batches: dict[str, dict[bytes, object]], protocol: int = 4) -> Path:
    root = directory / "cifar-10-batches-py"
    root.mkdir()
    for name, batch in batches.items():
        with open(root / name, "wb") as handle:
            pickle.dump(batch, handle, protocol=protocol)
    return root


# --------------------------------------------------------------------------- Dataset


def test_dataset_validates_dtypes_shapes_and_labels() -> None:
    x = np.zeros((4, 1, 2, 2), dtype=np.float32)
    y = np.array([0, 1, 2, 1], dtype=np.int64)
    assert len(Dataset("ok", x, y, 3)) == 4
    with pytest.raises(DataError, match="float32"):
        Dataset("bad", x.astype(np.float64), y, 3)
    with pytest.raises(DataError, match="int64"):
        Dataset("bad", x, y.astype(np.int32), 3)
    with pytest.raises(DataError, match="labels"):
        Dataset("bad", x, y[:3], 3)
    with pytest.raises(DataError, match=r"\[0, 2\)"):
        Dataset("bad", x, y, 2)
    with pytest.raises(DataError, match=r"\[0, 3\)"):
        Dataset("bad", x, np.array([0, -1, 2, 1], dtype=np.int64), 3)
    with pytest.raises(DataError, match="num_classes"):
        Dataset("bad", x, y, 0)
    assert issubclass(DataError, EdgeMeshError)


def test_dataset_accepts_any_sample_shape_with_at_least_one_dimension() -> None:
    y = np.array([0, 1, 2, 1], dtype=np.int64)
    features = Dataset("csv", np.zeros((4, 5), dtype=np.float32), y, 3)  # (N, F): the rows of a CSV file
    assert features.x.shape == (4, 5) and len(features) == 4
    assert Dataset("chw", np.zeros((4, 1, 2, 2), dtype=np.float32), y, 3).x.shape == (4, 1, 2, 2)
    assert Dataset("hw", np.zeros((4, 2, 2), dtype=np.float32), y, 3).x.shape == (4, 2, 2)
    with pytest.raises(DataError, match=r"sample_shape.*\(4,\)"):  # x.ndim == 1: samples with no shape
        Dataset("scalars", np.zeros(4, dtype=np.float32), y, 3)
    with pytest.raises(DataError, match="float32"):
        Dataset("doubles", np.zeros((4, 5), dtype=np.float64), y, 3)


def test_dataset_arrays_are_read_only_without_touching_caller_arrays() -> None:
    x = np.zeros((2, 1, 2, 2), dtype=np.float32)
    y = np.array([0, 1], dtype=np.int64)
    ds = Dataset("ro", x, y, 2)
    with pytest.raises(ValueError, match="read-only"):
        ds.x[0, 0, 0, 0] = 1.0
    x[0, 0, 0, 0] = 5.0  # the caller's own array stays writable
    assert ds.x[0, 0, 0, 0] == 5.0


# --------------------------------------------------------------------------- digits


def test_digits_shapes_dtypes_and_range() -> None:
    train, test = load_dataset("digits")
    assert len(train) + len(test) == 1797
    assert len(test) == pytest.approx(0.2 * 1797, abs=1)
    for ds in (train, test):
        assert ds.x.dtype == np.float32 and ds.y.dtype == np.int64
        assert ds.x.shape[1:] == (1, 8, 8)
        assert ds.num_classes == 10
        assert 0.0 <= ds.x.min() and ds.x.max() <= 1.0
    assert train.x.max() == 1.0  # 16/16: scaled by 16, not by 255


def test_digits_split_is_stratified() -> None:
    train, test = load_dataset("digits", test_fraction=0.3, seed=3)
    overall = label_distribution(np.concatenate([train.y, test.y]), 10)
    assert np.abs(label_distribution(train.y, 10) - overall).max() < 0.01
    assert np.abs(label_distribution(test.y, 10) - overall).max() < 0.01
    assert len(test) == pytest.approx(0.3 * 1797, abs=1)


def test_digits_is_deterministic_per_seed_and_cached() -> None:
    a_train, a_test = load_dataset("digits", seed=7)
    b_train, _ = load_dataset("digits", seed=7)
    assert b_train is a_train  # cached in-process
    c_train, c_test = load_dataset("digits", seed=8)
    assert not np.array_equal(a_train.y, c_train.y)
    # train and test partition the same images, whatever the seed
    assert sorted(np.concatenate([a_train.y, a_test.y])) == sorted(np.concatenate([c_train.y, c_test.y]))
    digits_module._load_digits.cache_clear()
    d_train, _ = load_dataset("digits", seed=7)
    assert d_train is not a_train
    np.testing.assert_array_equal(d_train.x, a_train.x)
    np.testing.assert_array_equal(d_train.y, a_train.y)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_digits_rejects_bad_test_fraction(fraction: float) -> None:
    with pytest.raises(DataError, match="test_fraction"):
        load_dataset("digits", test_fraction=fraction)


def test_unknown_dataset_names_known_ones() -> None:
    with pytest.raises(DataError, match="digits"):
        load_dataset("imagenet")


@pytest.mark.parametrize("name", DATASET_NAMES)
def test_every_dataset_name_has_a_loader(tmp_path: Path, name: str) -> None:
    try:
        train, test = load_dataset(name, tmp_path)
    except DataError as exc:  # mnist-idx, cifar10: the empty directory holds none of their files
        assert "unknown dataset" not in str(exc)
    else:
        assert len(train) > 0 and len(test) > 0



# --------------------------------------------------------------------------- MNIST IDX


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_loads_plain_and_gzip(tmp_path: Path, gz: bool) -> None:
    arrays = _write_mnist(tmp_path, gz=gz)
    train, test = load_dataset("mnist-idx", tmp_path)
    assert train.x.shape == (12, 1, 28, 28) and test.x.shape == (5, 1, 28, 28)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64
    np.testing.assert_allclose(train.x[:, 0], arrays["train-images-idx3-ubyte"] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(test.y, arrays["t10k-labels-idx1-ubyte"])
    assert train.num_classes == 10


def test_parse_idx_round_trips_other_dtypes() -> None:
    array = np.arange(-6, 6, dtype=np.int32).reshape(3, 4)
    np.testing.assert_array_equal(parse_idx(_idx_bytes(array, dtype_code=0x0C)), array)
    floats = np.linspace(0, 1, 5, dtype=np.float32)
    np.testing.assert_array_equal(parse_idx(_idx_bytes(floats, dtype_code=0x0D)), floats)


@pytest.mark.parametrize(
    ("mangle", "match"),
    [
        (lambda b: b[:-1], "truncated"),
        (lambda b: b + b"\x00", "trailing"),
        (lambda b: b[:10], "truncated"),
        (lambda b: b[:3], "truncated IDX header"),
        (lambda b: b"\x01" + b[1:], "magic"),
        (lambda b: b[:2] + b"\x07" + b[3:], "dtype"),
    ],
)
def test_parse_idx_rejects_garbled_files(mangle, match: str) -> None:  # type: ignore[no-untyped-def]
    good = _idx_bytes(np.zeros((2, 28, 28), dtype=np.uint8))
    with pytest.raises(DataError, match=match):
        parse_idx(mangle(good), source="some-file")


def test_truncated_mnist_file_names_the_file(tmp_path: Path) -> None:
    _write_mnist(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataError, match="train-images-idx3-ubyte.*truncated"):
        load_dataset("mnist-idx", tmp_path)


def test_mnist_wrong_magic_and_corrupt_gzip(tmp_path: Path) -> None:
    _write_mnist(tmp_path)
    path = tmp_path / "t10k-labels-idx1-ubyte"
    path.write_bytes(b"\xff\xff" + path.read_bytes()[2:])
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.*magic"):
        load_dataset("mnist-idx", tmp_path)
    path.unlink()
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte\.gz"):
        load_dataset("mnist-idx", tmp_path)


def test_mnist_image_label_count_mismatch(tmp_path: Path) -> None:
    _write_mnist(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(np.zeros(11, dtype=np.uint8)))
    with pytest.raises(DataError, match="12 images.*11 labels"):
        load_dataset("mnist-idx", tmp_path)


def test_mnist_labels_must_be_one_dimensional(tmp_path: Path) -> None:
    _write_mnist(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(np.zeros((12, 1), dtype=np.uint8)))
    with pytest.raises(DataError, match="train-labels"):
        load_dataset("mnist-idx", tmp_path)


def test_mnist_missing_file_or_directory(tmp_path: Path) -> None:
    _write_mnist(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte").unlink()
    with pytest.raises(DataError, match="t10k-images-idx3-ubyte"):
        load_dataset("mnist-idx", tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        load_dataset("mnist-idx", tmp_path / "nowhere")
    with pytest.raises(DataError, match="path"):
        load_dataset("mnist-idx")


# --------------------------------------------------------------------------- CIFAR-10


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar10_loads_present_batches_with_channel_major_layout(tmp_path: Path, protocol: int) -> None:
    b1, b3, tb = _cifar_batch(4, 1), _cifar_batch(3, 3), _cifar_batch(2, 9)
    data = b3[b"data"]
    assert isinstance(data, np.ndarray)
    data[1] = 0
    n, c, h, w = 1, 2, 5, 17  # blue channel, row 5, column 17 of the 2nd image of batch 3
    data[n, c * 1024 + h * 32 + w] = 200
    root = _write_cifar(tmp_path, {"data_batch_1": b1, "data_batch_3": b3, "test_batch": tb}, protocol)
    train, test = load_dataset("cifar10", root)
    assert train.x.shape == (7, 3, 32, 32) and test.x.shape == (2, 3, 32, 32)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64
    row = 4 + n  # batch 3 follows batch 1's four images
    assert train.x[row, c, h, w] == pytest.approx(200 / 255)
    assert np.count_nonzero(train.x[row]) == 1
    assert train.y.tolist() == b1[b"labels"] + b3[b"labels"]  # type: ignore[operator]
    np.testing.assert_allclose(test.x.reshape(2, -1), tb[b"data"] / 255.0, rtol=1e-6)  # type: ignore[operator]


def test_cifar10_requires_test_batch_and_a_data_batch(tmp_path: Path) -> None:
    root = _write_cifar(tmp_path, {"data_batch_2": _cifar_batch(2, 2)})
    with pytest.raises(DataError, match="test_batch"):
        load_dataset("cifar10", root)
    (root / "data_batch_2").rename(root / "test_batch")
    with pytest.raises(DataError, match="data_batch"):
        load_dataset("cifar10", root)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"\x80\x04garbage", "not a readable pickle"),
        (b"", "not a readable pickle"),
        (pickle.dumps([1, 2, 3]), "dict"),
        (pickle.dumps({b"data": np.zeros((2, 100), dtype=np.uint8), b"labels": [0, 1]}), "3072"),
        (pickle.dumps({b"data": np.zeros((2, 3072), dtype=np.float32), b"labels": [0, 1]}), "uint8"),
        (pickle.dumps({b"data": np.zeros((2, 3072), dtype=np.uint8), b"labels": [0]}), "labels"),
        (pickle.dumps({b"data": np.zeros((2, 3072), dtype=np.uint8), b"labels": [0, 10]}), "range"),
        (pickle.dumps({b"labels": [0]}), "data"),
    ],
)
def test_cifar10_garbled_batch_names_the_file(tmp_path: Path, content: bytes, match: str) -> None:
    root = _write_cifar(tmp_path, {"test_batch": _cifar_batch(2, 0)})
    (root / "data_batch_1").write_bytes(content)
    with pytest.raises(DataError, match=match) as info:
        load_dataset("cifar10", root)
    assert "data_batch_1" in str(info.value)


def test_cifar10_truncated_batch(tmp_path: Path) -> None:
    root = _write_cifar(tmp_path, {"data_batch_1": _cifar_batch(5, 1), "test_batch": _cifar_batch(2, 0)})
    path = root / "data_batch_1"
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(DataError, match="data_batch_1"):
        load_dataset("cifar10", root)


class _RunsShell:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


class _CallsEval:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.mark.parametrize("payload_cls", [_RunsShell, _CallsEval])
def test_malicious_pickle_is_refused_and_not_executed(tmp_path: Path, payload_cls: type) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps({b"data": payload_cls(marker), b"labels": [0]})
    # sanity check: the payload really would run if loaded with the ordinary unpickler
    pickle.loads(payload)  # noqa: S301
    assert marker.exists()
    marker.unlink()

    root = _write_cifar(tmp_path, {"test_batch": _cifar_batch(2, 0)})
    (root / "data_batch_1").write_bytes(payload)
    with pytest.raises(DataError, match="forbidden global"):
        load_dataset("cifar10", root)
    assert not marker.exists()


def test_restricted_unpickler_only_allows_latin1_codec() -> None:
    import codecs

    class _Zlib:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (codecs.encode, (b"x" * 10, "zlib"))

    with pytest.raises(DataError, match="latin1"):
        restricted_loads(pickle.dumps(_Zlib(), protocol=2))
    assert restricted_loads(pickle.dumps(b"\x00\xff", protocol=2)) == b"\x00\xff"


# --------------------------------------------------------------------------- synthetic CIFAR


def _nearest_class_mean_accuracy(train: Dataset, test: Dataset) -> float:
    """Accuracy on ``test`` of the classifier that picks the class whose mean ``train`` image is nearest."""
    flat_train, flat_test = train.x.reshape(len(train), -1), test.x.reshape(len(test), -1)
    means = np.stack([flat_train[train.y == c].mean(axis=0) for c in range(train.num_classes)])
    distances = (flat_test**2).sum(axis=1)[:, None] - 2 * flat_test @ means.T + (means**2).sum(axis=1)[None, :]
    return float((distances.argmin(axis=1) == test.y).mean())


def test_synthetic_cifar_is_cifar_shaped_balanced_and_deterministic_per_seed() -> None:
    train, test = load_dataset("synthetic-cifar", seed=5)
    assert (len(train), len(test)) == (SYNTHETIC_TRAIN, SYNTHETIC_TEST)
    for ds in (train, test):
        assert ds.x.dtype == np.float32 and ds.y.dtype == np.int64
        assert ds.x.shape[1:] == (3, 32, 32) and ds.num_classes == 10
        assert 0.0 <= ds.x.min() and ds.x.max() <= 1.0
        assert np.abs(label_distribution(ds.y, 10) - 0.1).max() < 0.04  # every class, about equally often
    again, _ = synthetic_cifar(seed=5)
    np.testing.assert_array_equal(again.x, train.x)
    np.testing.assert_array_equal(again.y, train.y)
    assert not np.array_equal(synthetic_cifar(seed=6)[0].x, train.x)
    small_train, small_test = synthetic_cifar(seed=5, train=100, test=30)
    assert (len(small_train), len(small_test)) == (100, 30)


def test_synthetic_cifar_classes_carry_over_from_train_to_test() -> None:
    """The images show their class, so a model can learn it: the nearest class mean of the train split labels
    most test images (0.79 and 0.81; on the labels of a random linear teacher on noise images, as the set once
    had, it reaches 0.25 and 0.22, and no CNN learns those in a few hundred steps). The splits share their
    class patterns but no sample (compared by each image's first row, which noise makes unique)."""
    for seed in (0, 1):
        train, test = synthetic_cifar(seed=seed)
        assert _nearest_class_mean_accuracy(train, test) > 0.5  # 0.1 is chance
        assert not (train.x[:, None, 0, 0, :] == test.x[None, :, 0, 0, :]).all(axis=-1).any()
