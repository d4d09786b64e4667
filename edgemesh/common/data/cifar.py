"""``"cifar10"`` and ``"synthetic-cifar"``: CIFAR-10's python batches, and generated CIFAR-shaped images.

CIFAR-10's python batches are pickles, so they are read with a restricted unpickler that can
rebuild numpy arrays and plain containers and nothing else. Errors name the file and the rule broken, never
what the pickle holds (a global's name, a codec, the unpickler's message).
"""

from __future__ import annotations

import importlib
import io
import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np

from edgemesh.common.data.dataset import UINT8_PIXEL_MAX, Dataset, register_dataset, require_dir
from edgemesh.common.errors import DataError

logger = logging.getLogger(__name__)

# --- CIFAR-10 python batches

CIFAR_DIR_NAME: Final = "cifar-10-batches-py"
CIFAR_TRAIN_BATCHES: Final = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_BATCH: Final = "test_batch"
CIFAR_IMAGE_SHAPE: Final = (3, 32, 32)
CIFAR_NUM_CLASSES: Final = 10


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """Stand-in for ``_codecs.encode`` (protocol-2 pickles of bytes); only latin-1 allowed."""
    if encoding.lower().replace("-", "").replace("_", "") != "latin1":
        raise DataError("pickle asked for a codec other than latin1, the only one allowed")
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
            raise DataError("pickle refers to a forbidden global (only numpy arrays and plain containers are "
                            "rebuilt)")
        return resolver()


def restricted_loads(data: bytes, *, source: str = "<bytes>") -> Any:
    """Unpickle ``data`` with :class:`RestrictedUnpickler` (byte strings stay bytes)."""
    try:
        return RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()
    except DataError as exc:
        raise DataError(f"{source}: {exc}") from exc
    except Exception as exc:  # any garbled pickle: UnpicklingError, EOFError, ValueError, ...
        raise DataError(f"{source}: not a readable pickle ({type(exc).__name__})") from exc


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
        raise DataError(f"{file}: cannot read: {exc.strerror or type(exc).__name__}") from exc
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


@register_dataset("cifar10")
def _cifar10(path: str | Path | None, *, test_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """``"cifar10"`` reads the ``cifar-10-batches-py`` directory ``path``; the other arguments do not apply."""
    return _load_cifar10(require_dir("cifar10", path))


# --- synthetic CIFAR-shaped images

SYNTHETIC_TRAIN = 2048
SYNTHETIC_TEST = 512
SYNTHETIC_GRID = 4
"""Side of the coarse random grids that are upsampled into smooth 32x32 patterns."""
SYNTHETIC_SHIFT = 4
"""Largest shift, in pixels, of a sample's class pattern in each direction."""
SYNTHETIC_CLASS_STD = 0.1
"""Standard deviation of a sample's class pattern, in pixel values."""
SYNTHETIC_CLUTTER_STD = 0.15
"""Standard deviation of a sample's own smooth pattern, stronger than its class's: it hides the class."""
SYNTHETIC_CONTRAST_STD = 0.1
"""Standard deviation of the factor around 1 that scales a sample's patterns."""
SYNTHETIC_BRIGHTNESS_STD = 0.05
"""Standard deviation of the offset around 0.5 added to a whole sample."""
SYNTHETIC_NOISE_STD = 0.05
"""Standard deviation of the independent noise of each pixel."""


def _smooth_patterns(rng: np.random.Generator, count: int, size: int) -> np.ndarray:
    """``count`` smooth random 3 x ``size`` x ``size`` patterns, each channel at mean 0, each pattern at std 1.

    Gaussian noise on a ``SYNTHETIC_GRID`` square grid, upsampled by linear interpolation along both axes:
    shapes and colour gradients that a few convolutions pick up, but that no single pixel gives away.
    """
    coarse = rng.standard_normal((count, 3, SYNTHETIC_GRID, SYNTHETIC_GRID), dtype=np.float32)
    at = np.linspace(0, SYNTHETIC_GRID - 1, size)
    up = np.stack([np.interp(at, np.arange(SYNTHETIC_GRID), row) for row in np.eye(SYNTHETIC_GRID)], axis=1)
    patterns = np.einsum("ik,nckl,jl->ncij", up.astype(np.float32), coarse, up.astype(np.float32))
    patterns -= patterns.mean(axis=(2, 3), keepdims=True)
    return patterns / patterns.std(axis=(1, 2, 3), keepdims=True)


def synthetic_cifar(*, seed: int = 0, train: int = SYNTHETIC_TRAIN, test: int = SYNTHETIC_TEST) -> tuple[Dataset,
                                                                                                        Dataset]:
    """CIFAR-shaped images (3x32x32 in [0, 1], 10 classes) that a CNN learns: each class a smooth random pattern.

    For benchmarks of CIFAR-shaped models where CIFAR-10 itself cannot be downloaded: the shapes and the work
    per sample are CIFAR's, and the held-out loss falls as a model learns, so the losses of two trainings say
    something. A sample is its class's pattern, shifted by up to ``SYNTHETIC_SHIFT`` pixels, under a stronger
    smooth pattern of its own (clutter), with its contrast and brightness jittered and noise on every pixel:
    the class is in no single pixel and not in the mean colour, so ``cifar-cnn`` needs a few hundred steps of
    SGD to tell most samples apart, not a few. Tuned on ``cifar-cnn`` with momentum 0.9 (seeds 0 to 2): at
    ``training.lr`` 0.02 and batch 32 or 64 the held-out loss goes from 2.30 to about 2.25 after 20 steps and
    to 0.5 to 1.05 after 200 (accuracy 0.68 to 0.84); at lr 0.1 and batch 64 (``edgemesh bench ddp``'s two
    workers of 32) to 1.1 to 1.3 after 200 (accuracy 0.6 to 0.7), less steadily: that rate is at the edge of
    what ``cifar-cnn`` takes. The labels are balanced; the train and test samples are drawn apart from the
    same class patterns of ``seed``.
    """
    rng = np.random.default_rng(seed)
    n = train + test
    templates = _smooth_patterns(rng, CIFAR_NUM_CLASSES, 32 + 2 * SYNTHETIC_SHIFT)
    y = rng.permutation(np.arange(n) % CIFAR_NUM_CLASSES).astype(np.int64)
    dy, dx = rng.integers(0, 2 * SYNTHETIC_SHIFT + 1, size=(2, n))
    windows = np.lib.stride_tricks.sliding_window_view(templates, (32, 32), axis=(2, 3))
    x = SYNTHETIC_CLASS_STD * windows[y, :, dy, dx] + SYNTHETIC_CLUTTER_STD * _smooth_patterns(rng, n, 32)
    x *= 1 + SYNTHETIC_CONTRAST_STD * rng.standard_normal((n, 1, 1, 1), dtype=np.float32)
    x += 0.5 + SYNTHETIC_BRIGHTNESS_STD * rng.standard_normal((n, 1, 1, 1), dtype=np.float32)
    x += SYNTHETIC_NOISE_STD * rng.standard_normal(x.shape, dtype=np.float32)
    np.clip(x, 0.0, 1.0, out=x)
    return (Dataset("synthetic-cifar-train", x[:train], y[:train], CIFAR_NUM_CLASSES),
            Dataset("synthetic-cifar-test", x[train:], y[train:], CIFAR_NUM_CLASSES))


@register_dataset("synthetic-cifar")
def _synthetic_cifar(path: str | Path | None, *, test_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """``"synthetic-cifar"`` draws the images of ``seed``; ``path`` and ``test_fraction`` do not apply."""
    return synthetic_cifar(seed=int(seed))
