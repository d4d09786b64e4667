"""Data sets, federated splits and mini-batch iteration.

Nothing is downloaded at run time. ``"digits"`` (scikit-learn's bundled 8x8 digits) is the
default; ``"mnist-idx"`` and ``"cifar10"`` read the official files from a directory the
operator provides; ``"synthetic-cifar"`` is generated CIFAR-shaped images of ten smooth random
class patterns, which a CNN learns, for benchmarks where CIFAR-10 cannot be downloaded. CIFAR-10's
python batches are pickles, so they are read with a restricted unpickler that can rebuild
numpy arrays and plain containers and nothing else.

Modules: ``dataset`` (:class:`Dataset`, the registry of named sets and :func:`load_dataset`),
``digits``, ``mnist`` (IDX files), ``cifar`` (CIFAR-10 batches, the restricted unpickler, the
synthetic set), ``partitions`` (:func:`split_indices`, :func:`shard`) and ``batches``
(:class:`BatchIterator`, :func:`batch_at`). Importing the package registers every data set.
``local`` reads a device's own data (:func:`load_local`) into :class:`LocalData`, each format by a module of its
own (``images``: image folders and :func:`read_image`; ``csv_file``; ``npz_file``), from inside the host's data
folder (``source``: :func:`data_path`) and within stated bounds (``MAX_DATA_BYTES``, ``MAX_CSV_BYTES``,
:func:`image_pixel_limit`).
"""

from __future__ import annotations

from edgemesh.common.data.batches import BatchIterator, batch_at
from edgemesh.common.data.cifar import (
    CIFAR_DIR_NAME,
    CIFAR_IMAGE_SHAPE,
    CIFAR_NUM_CLASSES,
    CIFAR_TEST_BATCH,
    CIFAR_TRAIN_BATCHES,
    SYNTHETIC_TEST,
    SYNTHETIC_TRAIN,
    RestrictedUnpickler,
    restricted_loads,
    synthetic_cifar,
)
from edgemesh.common.data.csv_file import MAX_CSV_BYTES, csv_rows
from edgemesh.common.data.dataset import DATASET_NAMES, UINT8_PIXEL_MAX, Dataset, load_dataset
from edgemesh.common.data.digits import DIGITS_COLUMNS, DIGITS_PIXEL_MAX, stratified_test_indices
from edgemesh.common.data.images import (
    IMAGE_SUFFIXES,
    MAX_IMAGE_PIXELS,
    MAX_SKIPPED_SHARE,
    image_pixel_limit,
    read_image,
)
from edgemesh.common.data.local import DATA_FORMATS, MAX_DATA_BYTES, LocalData, load_local
from edgemesh.common.data.mnist import MNIST_FILES, MNIST_IMAGE_SHAPE, MNIST_NUM_CLASSES, parse_idx
from edgemesh.common.data.npz_file import npz_samples
from edgemesh.common.data.partitions import SPLIT_SCHEMES, shard, split_indices
from edgemesh.common.data.source import data_path

__all__ = [
    "CIFAR_DIR_NAME",
    "CIFAR_IMAGE_SHAPE",
    "CIFAR_NUM_CLASSES",
    "CIFAR_TEST_BATCH",
    "CIFAR_TRAIN_BATCHES",
    "DATASET_NAMES",
    "DATA_FORMATS",
    "DIGITS_COLUMNS",
    "DIGITS_PIXEL_MAX",
    "IMAGE_SUFFIXES",
    "MAX_CSV_BYTES",
    "MAX_DATA_BYTES",
    "MAX_IMAGE_PIXELS",
    "MAX_SKIPPED_SHARE",
    "MNIST_FILES",
    "MNIST_IMAGE_SHAPE",
    "MNIST_NUM_CLASSES",
    "SPLIT_SCHEMES",
    "SYNTHETIC_TEST",
    "SYNTHETIC_TRAIN",
    "UINT8_PIXEL_MAX",
    "BatchIterator",
    "Dataset",
    "LocalData",
    "RestrictedUnpickler",
    "batch_at",
    "csv_rows",
    "npz_samples",
    "data_path",
    "image_pixel_limit",
    "load_dataset",
    "load_local",
    "parse_idx",
    "read_image",
    "restricted_loads",
    "shard",
    "split_indices",
    "stratified_test_indices",
    "synthetic_cifar",
]
