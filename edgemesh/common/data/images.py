"""A device's images: one file (:func:`read_image`) and the ``image-folder`` format (:func:`read_image_folder`).

A directory ``path/<class name>/<file>``. Files ending in ``.png``, ``.jpg`` or ``.jpeg`` (any case) are decoded by
Pillow's PNG or JPEG decoder alone, converted to grayscale or RGB by the channel count of ``input_shape`` and
resized to its height and width. Hidden entries and other files are ignored; a subfolder that is not a known class
is an error. An image Pillow cannot read, or larger than :func:`image_pixel_limit`, is skipped and counted, up to
``max_skipped_share`` of the folder's image files (``MAX_SKIPPED_SHARE``); above it the data is refused, naming how
many and the first one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

import numpy as np
from PIL import Image

from edgemesh.common.data.dataset import UINT8_PIXEL_MAX
from edgemesh.common.data.source import DataSource, Expected, Samples, check_bytes
from edgemesh.common.errors import DataError

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES: Final = (".png", ".jpg", ".jpeg")
IMAGE_DECODERS: Final = ("PNG", "JPEG")
"""The only Pillow decoders a device's image files go to, whatever their names say."""
MAX_SKIPPED_SHARE: Final = 0.05
"""Largest share of an image folder's image files that may be unreadable: those are skipped; above it, the folder is
refused (one broken photo among a thousand does not drop a device's data; a folder of broken files does)."""
MAX_IMAGE_PIXELS: Final = 16 * 2**20
"""Most pixels an image may decode to, unless ``input_shape`` itself is larger (:func:`image_pixel_limit`): a 16
megapixel photo takes at most 128 MiB on its way to ``input_shape``. A JPEG decodes at the smallest of its reduced
scales (1/2, 1/4, 1/8) that is still as large as ``input_shape``, so a camera's photos stay well under it."""
_IMAGE_MODES: Final = {1: "L", 3: "RGB"}
"""Pillow mode of an image by the channel count of the model's input."""
WIDE_GRAY_MODES: Final = ("I;16", "I;16B", "I;16L", "I;16N", "I")
"""Pillow modes of a 16-bit grayscale PNG (``I`` in older Pillow): read by their own range, ``WIDE_PIXEL_MAX``."""
WIDE_PIXEL_MAX: Final = 65535


def image_pixel_limit(input_shape: Sequence[int]) -> int:
    """Most pixels an image may decode to for a model input of ``input_shape``: ``MAX_IMAGE_PIXELS``, or the input's
    own height x width when it is larger."""
    return max(MAX_IMAGE_PIXELS, math.prod(input_shape[1:]))


def read_image(path: str | Path, input_shape: tuple[int, ...]) -> np.ndarray:
    """One image file as float32 (C, H, W) in [0, 1], with (C, H, W) = ``input_shape``.

    C = 1 reads the image as grayscale (Pillow mode ``"L"``), C = 3 as ``"RGB"``; it is resized to
    (H, W) with bilinear resampling. A 16-bit grayscale PNG is read by its own range (its values over 65,535, in
    every channel), not clipped at 8 bits. DataError naming the file if it is not a PNG or JPEG file Pillow can
    decode, or if it is larger than :func:`image_pixel_limit`.
    """
    try:
        return _decode(path, input_shape)
    except DataError as exc:
        raise DataError(f"image file '{path}' cannot be read: {exc}") from exc


def _decode(path: str | Path, input_shape: Sequence[int]) -> np.ndarray:
    """:func:`read_image`; DataError with the reason alone, never what the file holds (a decoder's message may)."""
    channels, height, width = _image_shape(tuple(input_shape))
    mode, limit = _IMAGE_MODES[channels], image_pixel_limit(input_shape)
    try:
        with Image.open(path, formats=IMAGE_DECODERS) as image:  # the header alone: nothing is decoded yet
            image.draft(mode, (width, height))  # a JPEG: its smallest reduced scale at least this large
            if image.width * image.height > limit:
                raise DataError(f"it is {image.width}x{image.height} pixels, more than the {limit:,} an image may "
                                f"be for input_shape {tuple(input_shape)}")
            if image.mode in WIDE_GRAY_MODES:
                return _wide_gray(image, channels, height, width)
            converted = image.convert(mode)
        if converted.size != (width, height):
            converted = converted.resize((width, height), Image.Resampling.BILINEAR)
    except DataError:
        raise
    except MemoryError:
        raise DataError("it does not fit in this device's memory to be decoded") from None
    except Exception as exc:  # Pillow's decoders raise many kinds of error on a damaged or foreign file
        logger.debug("%s: not decoded: %s", path, exc)
        raise DataError(f"not a PNG or JPEG file Pillow can decode ({type(exc).__name__})") from exc
    pixels = np.asarray(converted, dtype=np.float32) / np.float32(UINT8_PIXEL_MAX)
    return pixels[None, :, :] if channels == 1 else np.ascontiguousarray(pixels.transpose(2, 0, 1))


def _wide_gray(image: Image.Image, channels: int, height: int, width: int) -> np.ndarray:
    """A 16-bit grayscale image as float32 (C, H, W) in [0, 1]: its values over ``WIDE_PIXEL_MAX``, where Pillow's
    conversion to 8 bits clips every value above 255 to white (a sensor's or a depth camera's PNG read as blank)."""
    gray = Image.fromarray(np.asarray(image, dtype=np.float32) / np.float32(WIDE_PIXEL_MAX))  # mode F
    if gray.size != (width, height):
        gray = gray.resize((width, height), Image.Resampling.BILINEAR)
    pixels = np.clip(np.asarray(gray, dtype=np.float32), 0.0, 1.0)
    return np.ascontiguousarray(np.broadcast_to(pixels[None], (channels, height, width)))


def _image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise DataError(f"images need an input_shape of (C, H, W), got {input_shape!r}")
    channels, height, width = input_shape
    if channels not in _IMAGE_MODES:
        raise DataError(f"images are read with 1 (grayscale) or 3 (RGB) channels, input_shape has {channels}")
    return channels, height, width


def read_image_folder(source: DataSource, expected: Expected) -> Samples:
    """The images and labels of the class folders, and the image files skipped as unreadable."""
    source.check_directory("image-folder")
    shape = expected.shape
    _image_shape(shape)  # a bad shape is reported before any file is opened
    files = _image_files(source, expected.index)
    check_bytes(f"image folder '{source.shown}'", len(files), shape, expected.max_bytes)
    images = np.empty((len(files), *shape), dtype=np.float32)
    labels = np.empty(len(files), dtype=np.int64)
    read = 0
    skipped: list[tuple[str, str]] = []
    for file, label in files:
        try:
            images[read] = _decode(file, shape)
        except DataError as exc:
            skipped.append((file.relative_to(source.path).as_posix(), str(exc)))
            continue
        labels[read] = label
        read += 1
    _check_skipped(source, skipped, len(files), expected.max_skipped_share)
    if not read:
        raise DataError(f"data path '{source.shown}' holds no images ({', '.join(IMAGE_SUFFIXES)}) in class folders")
    return Samples(images[:read], labels[:read], [relative for relative, _ in skipped])


def _image_files(source: DataSource, index: dict[str, int]) -> list[tuple[Path, int]]:
    """The image files of the class folders, in reading order, with their labels: each inside the data folder."""
    files: list[tuple[Path, int]] = []
    for folder in sorted(source.path.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        if folder.name not in index:
            raise DataError(f"folder '{source.name(folder)}' is not one of the job's classes; known: "
                            f"{', '.join(index)}")
        files += [(file, index[folder.name]) for file in _class_images(source, folder)]
    return files


def _class_images(source: DataSource, folder: Path) -> Iterator[Path]:
    """The image files of a class folder and of its subfolders at any depth (a camera's ``DCIM/100MEDIA``), hidden
    ones left out: a folder's files in name order, then its subfolders'. Each is checked to be inside the data folder;
    a folder reached again through a link is read once."""
    seen: set[Path] = set()
    pending = [folder]
    while pending:
        current = pending.pop()
        source.check_inside(current)
        real = current.resolve()
        if real in seen:
            continue
        seen.add(real)
        subfolders: list[Path] = []
        for entry in sorted(current.iterdir()):
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                subfolders.append(entry)
            elif entry.suffix.lower() in IMAGE_SUFFIXES and entry.is_file():
                source.check_inside(entry)
                yield entry
        pending += reversed(subfolders)


def _check_skipped(source: DataSource, skipped: list[tuple[str, str]], total: int, max_share: float) -> None:
    """DataError when more than ``max_share`` of the ``total`` image files were skipped (``(file, why)``), else a
    warning naming how many and the first."""
    if not skipped:
        return
    first, why = skipped[0]
    if len(skipped) > max_share * total:
        raise DataError(f"{len(skipped)} of the {total} image files in '{source.shown}' cannot be read, more than "
                        f"the {max_share:.0%} a device may skip; the first: '{first}' ({why})")
    logger.warning("%s: skipped %d of the %d image files, which cannot be read (at most %.0f%% may be); "
                   "the first: '%s' (%s)", source.shown, len(skipped), total, max_share * 100, first, why)
