"""``"mnist-idx"``: MNIST from the official IDX files (plain or gzipped) in a directory."""

from __future__ import annotations

import gzip
import logging
import struct
from pathlib import Path
from typing import Any, Final

import numpy as np

from edgemesh.common.data.dataset import UINT8_PIXEL_MAX, Dataset, register_dataset, require_dir
from edgemesh.common.errors import DataError

logger = logging.getLogger(__name__)

MNIST_FILES: Final = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MNIST_IMAGE_SHAPE: Final = (28, 28)
MNIST_NUM_CLASSES: Final = 10

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


def parse_idx(data: bytes, *, source: str = "<bytes>") -> np.ndarray:
    """Parse the bytes of one IDX file into a native-endian numpy array.

    Validates the magic number, the dtype code, that the header is complete and that the
    payload length equals the product of the dimensions. ``source`` names the file in errors.
    """
    if len(data) < _IDX_HEADER_SIZE:
        raise DataError(f"{source}: truncated IDX header ({len(data)} bytes)")
    if data[:2] != _IDX_MAGIC_PREFIX:
        raise DataError(f"{source}: bad IDX magic number (an IDX file starts with two zero bytes)")
    dtype_code, ndims = data[2], data[3]
    dtype = _IDX_DTYPES.get(dtype_code)
    if dtype is None:
        known = ", ".join(f"0x{code:02x}" for code in _IDX_DTYPES)
        raise DataError(f"{source}: unknown IDX dtype code in its third byte (known: {known})")
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
            raise DataError(f"{plain}: cannot read: {exc.strerror or type(exc).__name__}") from exc
    if gz.is_file():
        try:
            with gzip.open(gz, "rb") as handle:
                return handle.read(), str(gz)
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise DataError(f"{gz}: corrupt gzip file ({type(exc).__name__})") from exc
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


@register_dataset("mnist-idx")
def _mnist_idx(path: str | Path | None, *, test_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """``"mnist-idx"`` reads the directory ``path``; ``test_fraction`` and ``seed`` do not apply."""
    return _load_mnist_idx(require_dir("mnist-idx", path))
