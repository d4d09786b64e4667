"""Data sets, federated splits and mini-batch iteration.

Nothing is downloaded at run time. ``"digits"`` (scikit-learn's bundled 8x8 digits) is the
default; ``"mnist-idx"`` and ``"cifar10"`` read the official files from a directory the
operator provides. CIFAR-10's python batches are pickles, so they are read with a restricted
unpickler that can rebuild numpy arrays and plain containers and nothing else.
"""

from __future__ import annotations

import functools
import gzip
import importlib
import importlib.util
import io
import logging
import pickle
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from edgemesh.common.errors import DataError

logger = logging.getLogger(__name__)

DATASET_NAMES: Final = ("digits", "mnist-idx", "cifar10", "synthetic-cifar")
SPLIT_SCHEMES: Final = ("iid", "dirichlet")

MNIST_FILES: Final = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MNIST_IMAGE_SHAPE: Final = (28, 28)
MNIST_NUM_CLASSES: Final = 10

CIFAR_DIR_NAME: Final = "cifar-10-batches-py"
CIFAR_TRAIN_BATCHES: Final = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_BATCH: Final = "test_batch"
CIFAR_IMAGE_SHAPE: Final = (3, 32, 32)
CIFAR_NUM_CLASSES: Final = 10

DIGITS_PIXEL_MAX: Final = 16.0
DIGITS_COLUMNS: Final = 65
"""64 pixels and the label per row of scikit-learn's digits.csv.gz."""
UINT8_PIXEL_MAX: Final = 255.0

# IDX header: two zero bytes, a dtype code, the number of dimensions; then one big-endian
# int32 per dimension. Data follow in big-endian order.
_IDX_MAGIC_PREFIX: Final = b"\x00\x00"
_IDX_HEADER_SIZE: Final = 4
_IDX_DIM_SIZE: Final = 4
_IDX_DTYPES: Final[dict[int, np.dtype[Any]]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


@dataclass(frozen=True, slots=True)
class Dataset:
    """An in-memory labelled image set.

    ``x`` is float32 of shape (N, C, H, W), ``y`` int64 of shape (N,) with labels in
    ``[0, num_classes)``. The stored arrays are read-only views, so a cached data set
    cannot be changed by one of its users.
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        if not isinstance(self.x, np.ndarray) or not isinstance(self.y, np.ndarray):
            raise DataError(f"dataset {self.name!r}: x and y must be numpy arrays")
        if self.x.dtype != np.float32 or self.x.ndim != 4:
            raise DataError(
                f"dataset {self.name!r}: x must be float32 of shape (N, C, H, W), "
                f"got {self.x.dtype} {self.x.shape}"
            )
        if self.y.dtype != np.int64 or self.y.ndim != 1:
            raise DataError(
                f"dataset {self.name!r}: y must be int64 of shape (N,), got {self.y.dtype} {self.y.shape}"
            )
        if self.x.shape[0] != self.y.shape[0]:
            raise DataError(f"dataset {self.name!r}: {self.x.shape[0]} images but {self.y.shape[0]} labels")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int):
            raise DataError(f"dataset {self.name!r}: num_classes must be an int")
        if self.num_classes < 1:
            raise DataError(f"dataset {self.name!r}: num_classes must be >= 1, got {self.num_classes}")
        if self.y.size and (int(self.y.min()) < 0 or int(self.y.max()) >= self.num_classes):
            raise DataError(
                f"dataset {self.name!r}: labels must lie in [0, {self.num_classes}), "
                f"got [{int(self.y.min())}, {int(self.y.max())}]"
            )
        object.__setattr__(self, "x", _read_only_view(self.x))
        object.__setattr__(self, "y", _read_only_view(self.y))

    def __len__(self) -> int:
        return int(self.y.shape[0])


def _read_only_view(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


# --------------------------------------------------------------------------- loading


def load_dataset(
    name: str,
    path: str | Path | None = None,
    *,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> tuple[Dataset, Dataset]:
    """Load a named data set and return ``(train, test)``.

    ``test_fraction`` and ``seed`` choose the stratified split of ``"digits"``; MNIST and
    CIFAR-10 come with their official train/test split and ignore them. ``path`` is the
    directory holding the MNIST IDX files, or the ``cifar-10-batches-py`` directory.
    """
    if name == "digits":
        return _load_digits(float(test_fraction), int(seed))
    if name == "mnist-idx":
        return _load_mnist_idx(_require_dir(name, path))
    if name == "cifar10":
        return _load_cifar10(_require_dir(name, path))
    if name == "synthetic-cifar":
        return synthetic_cifar(seed=int(seed))
    raise DataError(f"unknown dataset {name!r}; known: {', '.join(DATASET_NAMES)}")


def _require_dir(name: str, path: str | Path | None) -> Path:
    if path is None:
        raise DataError(f"dataset {name!r} needs a directory path")
    directory = Path(path)
    if not directory.is_dir():
        raise DataError(f"dataset {name!r}: directory {str(directory)!r} does not exist")
    return directory


def _read_digits_csv() -> tuple[np.ndarray, np.ndarray]:
    """The digits data set as scikit-learn ships it (``datasets/data/digits.csv.gz``).

    Read straight from the package data: importing scikit-learn would cost a worker about
    90 MiB of memory, a tenth of a Raspberry Pi 3.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the digits data set needs scikit-learn installed (pip install scikit-learn)")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    try:
        with gzip.open(path, "rt") as fh:
            table = np.loadtxt(fh, delimiter=",", dtype=np.float32)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read the digits data set: {exc}") from exc
    if table.ndim != 2 or table.shape[1] != DIGITS_COLUMNS:
        raise DataError(f"{path}: expected {DIGITS_COLUMNS} columns, got shape {table.shape}")
    return np.ascontiguousarray(table[:, :-1]), table[:, -1].astype(np.int64)


def stratified_test_indices(labels: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
    """Indices of a held-out split with each class in proportion, deterministic for ``seed``."""
    rng = np.random.default_rng(seed)
    picked = []
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        picked.append(members[: int(round(len(members) * test_fraction))])
    return np.sort(np.concatenate(picked))


@functools.lru_cache(maxsize=8)
def _load_digits(test_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    pixels, labels = _read_digits_csv()
    x = (pixels.reshape(-1, 8, 8) / np.float32(DIGITS_PIXEL_MAX))[:, None, :, :]
    y = labels
    test_idx = stratified_test_indices(y, test_fraction, seed)
    if len(test_idx) == 0 or len(test_idx) == len(y):
        raise DataError(f"digits: cannot split with test_fraction={test_fraction}")
    train_mask = np.ones(len(y), dtype=bool)
    train_mask[test_idx] = False
    x_train, y_train = x[train_mask], y[train_mask]
    x_test, y_test = x[test_idx], y[test_idx]
    num_classes = int(y.max()) + 1
    logger.debug("digits loaded: %d train, %d test (seed=%d)", len(y_train), len(y_test), seed)
    return (
        Dataset("digits-train", np.ascontiguousarray(x_train), np.ascontiguousarray(y_train), num_classes),
        Dataset("digits-test", np.ascontiguousarray(x_test), np.ascontiguousarray(y_test), num_classes),
    )


# --- synthetic CIFAR-shaped images

SYNTHETIC_TRAIN = 2048
SYNTHETIC_TEST = 512


def synthetic_cifar(*, seed: int = 0, train: int = SYNTHETIC_TRAIN, test: int = SYNTHETIC_TEST) -> tuple[Dataset,
                                                                                                        Dataset]:
    """Random 3x32x32 images in [0, 1] labelled by a fixed random linear teacher (10 classes).

    For timing and memory benchmarks of CIFAR-shaped models where CIFAR-10 itself cannot be
    downloaded: the shapes and the work per sample are CIFAR's, the accuracy means nothing.
    """
    rng = np.random.default_rng(seed)
    x = rng.random((train + test, 3, 32, 32), dtype=np.float32)
    teacher = rng.standard_normal((3 * 32 * 32, 10)).astype(np.float32)
    y = np.argmax((x.reshape(len(x), -1) - 0.5) @ teacher, axis=1).astype(np.int64)
    return (Dataset("synthetic-cifar-train", x[:train], y[:train], 10),
            Dataset("synthetic-cifar-test", x[train:], y[train:], 10))


# --- MNIST IDX


def parse_idx(data: bytes, *, source: str = "<bytes>") -> np.ndarray:
    """Parse the bytes of one IDX file into a native-endian numpy array.

    Validates the magic number, the dtype code, that the header is complete and that the
    payload length equals the product of the dimensions. ``source`` names the file in errors.
    """
    if len(data) < _IDX_HEADER_SIZE:
        raise DataError(f"{source}: truncated IDX header ({len(data)} bytes)")
    if data[:2] != _IDX_MAGIC_PREFIX:
        raise DataError(f"{source}: bad IDX magic number {data[:4].hex()}")
    dtype_code, ndims = data[2], data[3]
    dtype = _IDX_DTYPES.get(dtype_code)
    if dtype is None:
        raise DataError(f"{source}: unknown IDX dtype code 0x{dtype_code:02x}")
    if ndims == 0:
        raise DataError(f"{source}: IDX file declares zero dimensions")
    header_end = _IDX_HEADER_SIZE + _IDX_DIM_SIZE * ndims
    if len(data) < header_end:
        raise DataError(f"{source}: truncated IDX header, {ndims} dimensions declared")
    dims = struct.unpack(f">{ndims}i", data[_IDX_HEADER_SIZE:header_end])
    if any(d < 0 for d in dims):
        raise DataError(f"{source}: negative IDX dimension in {dims}")
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    actual = len(data) - header_end
    if actual != expected:
        raise DataError(
            f"{source}: IDX payload is {actual} bytes but dimensions {dims} need {expected} "
            f"({'truncated' if actual < expected else 'trailing data'})"
        )
    array = np.frombuffer(data, dtype=dtype, offset=header_end).reshape(dims)
    return array.astype(dtype.newbyteorder("="), copy=True)


def _read_maybe_gz(directory: Path, filename: str) -> tuple[bytes, str]:
    plain = directory / filename
    gz = directory / f"{filename}.gz"
    if plain.is_file():
        try:
            return plain.read_bytes(), str(plain)
        except OSError as exc:
            raise DataError(f"{plain}: cannot read: {exc}") from exc
    if gz.is_file():
        try:
            with gzip.open(gz, "rb") as handle:
                return handle.read(), str(gz)
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise DataError(f"{gz}: corrupt gzip file: {exc}") from exc
    raise DataError(f"missing file {plain} (or {gz.name}) in {directory}")


def _load_mnist_part(directory: Path, part: str) -> Dataset:
    image_file, label_file = MNIST_FILES[part]
    image_bytes, image_source = _read_maybe_gz(directory, image_file)
    label_bytes, label_source = _read_maybe_gz(directory, label_file)
    images = parse_idx(image_bytes, source=image_source)
    labels = parse_idx(label_bytes, source=label_source)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != MNIST_IMAGE_SHAPE:
        raise DataError(
            f"{image_source}: expected uint8 images of shape (N, 28, 28), got {images.dtype} {images.shape}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise DataError(
            f"{label_source}: expected uint8 labels of shape (N,), got {labels.dtype} {labels.shape}"
        )
    if images.shape[0] != labels.shape[0]:
        raise DataError(
            f"{image_source} holds {images.shape[0]} images but {label_source} holds {labels.shape[0]} labels"
        )
    if labels.size and int(labels.max()) >= MNIST_NUM_CLASSES:
        raise DataError(f"{label_source}: label {int(labels.max())} out of range [0, {MNIST_NUM_CLASSES})")
    x = (images.astype(np.float32) / np.float32(UINT8_PIXEL_MAX))[:, None, :, :]
    return Dataset(f"mnist-{part}", x, labels.astype(np.int64), MNIST_NUM_CLASSES)


def _load_mnist_idx(directory: Path) -> tuple[Dataset, Dataset]:
    train, test = _load_mnist_part(directory, "train"), _load_mnist_part(directory, "test")
    logger.debug("mnist-idx loaded from %s: %d train, %d test", directory, len(train), len(test))
    return train, test


# --- CIFAR-10 python batches


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """Stand-in for ``_codecs.encode`` (protocol-2 pickles of bytes); only latin-1 allowed."""
    if encoding.lower().replace("-", "").replace("_", "") != "latin1":
        raise DataError(f"pickle asked for codec {encoding!r}; only latin1 is allowed")
    if not isinstance(text, str):
        raise DataError("pickle passed a non-string to _codecs.encode")
    return text.encode("latin1")


def _import_attr(candidates: tuple[str, ...], name: str) -> Callable[[], Any]:
    def resolve() -> Any:
        for module_name in candidates:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            if hasattr(module, name):
                return getattr(module, name)
        raise DataError(f"cannot resolve {name} in {candidates}")

    return resolve


def _constant(obj: Any) -> Callable[[], Any]:
    return lambda: obj


_NUMPY_MULTIARRAY: Final = ("numpy._core.multiarray", "numpy.core.multiarray")
_NUMPY_NUMERIC: Final = ("numpy._core.numeric", "numpy.core.numeric")

# (module, name) as written in the pickle -> resolver of the object allowed for it.
_PICKLE_ALLOWED: Final[dict[tuple[str, str], Callable[[], Any]]] = {
    **{
        (module, name): _import_attr(_NUMPY_MULTIARRAY, name)
        for module in _NUMPY_MULTIARRAY
        for name in ("_reconstruct", "scalar")
    },
    **{(module, "_frombuffer"): _import_attr(_NUMPY_NUMERIC, "_frombuffer") for module in _NUMPY_NUMERIC},
    ("numpy", "ndarray"): _constant(np.ndarray),
    ("numpy", "dtype"): _constant(np.dtype),
    ("_codecs", "encode"): _constant(_latin1_encode),
    **{
        (module, cls.__name__): _constant(cls)
        for module in ("builtins", "__builtin__")
        for cls in (list, dict, tuple, set, frozenset, bytes, bytearray)
    },
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that can only rebuild numpy arrays and plain containers.

    Every global a pickle asks for goes through :meth:`find_class`; anything not on the
    allow-list raises :class:`DataError` before it is imported, let alone called.
    """

    def find_class(self, module: str, name: str) -> Any:
        resolver = _PICKLE_ALLOWED.get((module, name))
        if resolver is None:
            raise DataError(f"pickle refers to forbidden global {module}.{name}")
        return resolver()


def restricted_loads(data: bytes, *, source: str = "<bytes>") -> Any:
    """Unpickle ``data`` with :class:`RestrictedUnpickler` (byte strings stay bytes)."""
    try:
        return RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()
    except DataError as exc:
        raise DataError(f"{source}: {exc}") from exc
    except Exception as exc:  # any garbled pickle: UnpicklingError, EOFError, ValueError, ...
        raise DataError(f"{source}: not a readable pickle ({type(exc).__name__}: {exc})") from exc


def _batch_field(batch: dict[Any, Any], key: str) -> Any:
    for candidate in (key.encode(), key):
        if candidate in batch:
            return batch[candidate]
    raise DataError(f"missing key {key!r}")


def _parse_cifar_batch(batch: Any, *, source: str) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(batch, dict):
        raise DataError(f"{source}: CIFAR batch must be a dict, got {type(batch).__name__}")
    try:
        data, labels = _batch_field(batch, "data"), _batch_field(batch, "labels")
    except DataError as exc:
        raise DataError(f"{source}: {exc}") from exc
    pixels_per_image = int(np.prod(CIFAR_IMAGE_SHAPE))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        raise DataError(f"{source}: b'data' must be a 2-D uint8 array")
    if data.shape[1] != pixels_per_image:
        raise DataError(f"{source}: b'data' rows hold {data.shape[1]} values, expected {pixels_per_image}")
    try:
        label_array = np.asarray(labels)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{source}: b'labels' is not a list of ints") from exc
    if label_array.ndim != 1 or not np.issubdtype(label_array.dtype, np.integer):
        raise DataError(f"{source}: b'labels' must be a flat list of ints")
    if label_array.shape[0] != data.shape[0]:
        raise DataError(f"{source}: {data.shape[0]} images but {label_array.shape[0]} labels")
    if label_array.size and (int(label_array.min()) < 0 or int(label_array.max()) >= CIFAR_NUM_CLASSES):
        raise DataError(f"{source}: labels out of range [0, {CIFAR_NUM_CLASSES})")
    return data.reshape((-1, *CIFAR_IMAGE_SHAPE)), label_array.astype(np.int64)


def _read_cifar_batch(file: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise DataError(f"{file}: cannot read: {exc}") from exc
    return _parse_cifar_batch(restricted_loads(raw, source=str(file)), source=str(file))


def _cifar_dataset(name: str, parts: list[tuple[np.ndarray, np.ndarray]]) -> Dataset:
    x = np.concatenate([p[0] for p in parts]).astype(np.float32) / np.float32(UINT8_PIXEL_MAX)
    y = np.concatenate([p[1] for p in parts])
    return Dataset(name, x, y, CIFAR_NUM_CLASSES)


def _load_cifar10(directory: Path) -> tuple[Dataset, Dataset]:
    train_files = [directory / n for n in CIFAR_TRAIN_BATCHES if (directory / n).is_file()]
    if not train_files:
        raise DataError(f"no CIFAR-10 training batch ({CIFAR_TRAIN_BATCHES[0]}..) in {directory}")
    test_file = directory / CIFAR_TEST_BATCH
    if not test_file.is_file():
        raise DataError(f"missing file {test_file}")
    train = _cifar_dataset("cifar10-train", [_read_cifar_batch(f) for f in train_files])
    test = _cifar_dataset("cifar10-test", [_read_cifar_batch(test_file)])
    logger.debug(
        "cifar10 loaded from %s: %d train (%d batches), %d test",
        directory,
        len(train),
        len(train_files),
        len(test),
    )
    return train, test


# --------------------------------------------------------------------------- splitting


def split_indices(
    labels: np.ndarray,
    num_shards: int,
    *,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    weights: Sequence[float] | None = None,
) -> list[np.ndarray]:
    """Split sample indices into ``num_shards`` disjoint, non-empty, sorted int64 arrays.

    ``"iid"`` shuffles and cuts into near-equal parts, or into parts in proportion to
    ``weights`` (one per shard: a shard that trains more samples per iteration holds more, so
    that every sample is drawn about as often and uneven batches do not bias the gradient).
    ``"dirichlet"`` draws, for each class, the proportions of that class given to each shard
    from Dirichlet(alpha) (``weights`` do not apply): small alpha
    means each shard sees few classes. Empty shards are repaired by moving samples from the
    largest shard. The result depends only on the arguments.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DataError(f"labels must be 1-D, got shape {labels.shape}")
    if isinstance(num_shards, bool) or not isinstance(num_shards, int | np.integer):
        raise DataError(f"num_shards must be an int, got {num_shards!r}")
    if not 1 <= num_shards <= labels.shape[0]:
        raise DataError(f"num_shards must lie in [1, {labels.shape[0]}], got {num_shards}")
    if scheme not in SPLIT_SCHEMES:
        raise DataError(f"unknown split scheme {scheme!r}; known: {', '.join(SPLIT_SCHEMES)}")
    if not (alpha > 0 and np.isfinite(alpha)):
        raise DataError(f"alpha must be a positive finite number, got {alpha}")
    if weights is not None and (len(weights) != num_shards or not all(w > 0 and np.isfinite(w) for w in weights)):
        raise DataError(f"need {num_shards} positive shard weights, got {list(weights)}")
    rng = np.random.default_rng(seed)
    if scheme == "iid" and weights is not None:
        order = rng.permutation(labels.shape[0])
        cuts = np.round(np.cumsum(weights)[:-1] / sum(weights) * labels.shape[0]).astype(np.int64)
        shards = np.split(order, cuts)
    elif scheme == "iid":
        shards = np.array_split(rng.permutation(labels.shape[0]), int(num_shards))
    else:
        shards = _dirichlet_shards(labels, int(num_shards), float(alpha), rng)
    return [np.sort(s).astype(np.int64) for s in _repair_empty(shards)]


def _dirichlet_shards(
    labels: np.ndarray, num_shards: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    parts: list[list[np.ndarray]] = [[] for _ in range(num_shards)]
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        proportions = rng.dirichlet(np.full(num_shards, alpha))
        cuts = (np.cumsum(proportions)[:-1] * members.shape[0]).astype(np.int64)
        for shard_id, piece in enumerate(np.split(members, cuts)):
            parts[shard_id].append(piece)
    return [np.concatenate(p) if p else np.empty(0, dtype=np.int64) for p in parts]


def _repair_empty(shards: list[np.ndarray]) -> list[np.ndarray]:
    """Give each empty shard one sample taken from the currently largest shard."""
    shards = [np.asarray(s, dtype=np.int64) for s in shards]
    for i, current in enumerate(shards):
        if current.size:
            continue
        donor = max(range(len(shards)), key=lambda j: (shards[j].size, -j))
        shards[i] = shards[donor][-1:]
        shards[donor] = shards[donor][:-1]
    return shards


def shard(
    dataset: Dataset,
    index: int,
    count: int,
    *,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    weights: Sequence[float] | None = None,
) -> Dataset:
    """Return the ``index``-th of ``count`` shards of ``dataset`` (see :func:`split_indices`)."""
    if not isinstance(index, int | np.integer) or not 0 <= index < count:
        raise DataError(f"shard index must lie in [0, {count}), got {index!r}")
    indices = split_indices(dataset.y, count, scheme=scheme, alpha=alpha, seed=seed, weights=weights)[index]
    return Dataset(
        f"{dataset.name}[{index}/{count}]", dataset.x[indices], dataset.y[indices], dataset.num_classes
    )


# --------------------------------------------------------------------------- batching


class BatchIterator(Iterator[tuple[np.ndarray, np.ndarray]]):
    """Endless ``(x, y)`` mini-batches over a data set, reshuffled every epoch.

    ``batch_size`` may be changed between batches; the current epoch continues with the
    new size. The last batch of an epoch may be smaller. ``epoch`` counts the full passes
    completed so far. A batch size larger than the data set yields the whole set.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, seed: int = 0) -> None:
        if len(dataset) == 0:
            raise DataError(f"cannot iterate over empty dataset {dataset.name!r}")
        self._dataset = dataset
        self._rng = np.random.default_rng(seed)
        self._batch_size = _check_batch_size(batch_size)
        self._order = self._rng.permutation(len(dataset))
        self._position = 0
        self.epoch = 0

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._batch_size = _check_batch_size(value)

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        if self._position >= self._order.shape[0]:
            self._order = self._rng.permutation(len(self._dataset))
            self._position = 0
        stop = min(self._position + self._batch_size, self._order.shape[0])
        chosen = self._order[self._position : stop]
        self._position = stop
        if stop == self._order.shape[0]:
            self.epoch += 1
        return self._dataset.x[chosen], self._dataset.y[chosen]


def _check_batch_size(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise DataError(f"batch_size must be a positive int, got {value!r}")
    return int(value)


def batch_at(dataset: Dataset, batch_size: int, *, seed: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of ``step``: a pure function of ``(seed, step)``, so every member of a
    model-parallel cluster draws the same samples without talking (``batch_size`` samples without
    replacement, the whole set if it is smaller)."""
    if len(dataset) == 0:
        raise DataError(f"cannot draw batches from empty dataset {dataset.name!r}")
    size = min(_check_batch_size(batch_size), len(dataset))
    rng = np.random.default_rng([seed, step])
    index = np.sort(rng.choice(len(dataset), size=size, replace=False))
    return dataset.x[index], dataset.y[index]
