"""``edgemesh predict MODEL INPUT... [--top K] [--json] [--trust-code [--module-path DIR]]``: classify inputs with
a model ``edgemesh job export`` wrote.

The model card beside MODEL (``MODEL.card.json``) gives the classes, the input shape and the format.
An ONNX model runs on onnxruntime and numpy alone: torch is imported only for safetensors and torch
files, so a board that only does inference needs onnxruntime, numpy and Pillow. A safetensors or
torch file holds weights only; the model is rebuilt from the job file the card carries. When that job
builds its model with an entry point (Python code), nothing is imported unless the user passes
``--trust-code``: then its module is imported from the ``--module-path`` directories, then MODEL's folder,
then the installed packages.

Inputs are image files (PNG, JPEG: converted and resized to the model's (C, H, W) as in training,
pixels in [0, 1]), ``.npy`` arrays of exactly the input shape (uint8 is scaled to [0, 1]), CSV files (each row an
input, as a device's CSV data is read: a header row, every column but the job's ``label_column`` a feature), ``.npz``
archives (each sample of ``x`` an input, its class in ``y`` if the archive has one, as a device's npz data), or
folders: a folder stands for every image and array file below it, at any depth, hidden ones left out, in name
order. The normalization is inside the model. Per input, one line ``path  class (p=0.93)`` (a CSV row:
``file.csv:LINE``; an archive's sample: ``file.npz:INDEX``) with the top K classes by softmax probability, or with
``--json`` one JSON object per line. Inputs are read and classified ``PREDICT_BATCH`` at a time, so a folder or
file of any size runs in the memory of one batch; an input that cannot be read stops the command with its name,
after the lines of the batches before its own.

Where an input says its class (a CSV row's label, an archive's ``y``, an image or array in a folder named after a
class, as image-folder data is laid out), the last line, on standard error, says how many of those the model got right.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Final

import numpy as np

from edgemesh.common.data import IMAGE_SUFFIXES, UINT8_PIXEL_MAX, csv_rows, npz_samples, read_image
from edgemesh.common.errors import DataError, ExportError
from edgemesh.common.jobs import parse_job
from edgemesh.operator.export import INSTALL_HINT, TRUST_FLAG, ModelCard, card_path

PREDICT_BATCH: Final = 64
"""Inputs per forward pass."""
ARRAY_SUFFIX: Final = ".npy"
CSV_SUFFIX: Final = ".csv"
ARCHIVE_SUFFIX: Final = ".npz"

Classifier = Callable[[np.ndarray], np.ndarray]
"""A float32 batch (N, *input_shape) -> its logits (N, classes)."""
Sample = tuple[str, np.ndarray, int | None]
"""An input's name, its float32 sample, and the class it says it is (None: it says none)."""


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a model file written by 'edgemesh job export' "
                                                       "(its card MODEL.card.json beside it)")
    parser.add_argument("inputs", metavar="INPUT", nargs="+",
                        help=f"image files ({', '.join(IMAGE_SUFFIXES)}), {ARRAY_SUFFIX} arrays of the input shape, "
                             f"{CSV_SUFFIX} files (a row each), {ARCHIVE_SUFFIX} archives (a sample of x each), or "
                             "folders of images and arrays (every such file below a folder, hidden ones left out)")
    parser.add_argument("--top", type=_positive, default=1, metavar="K", help="print the K likeliest classes (1)")
    parser.add_argument("--json", action="store_true", help="one JSON object per input: {input, top: [{class, p}]}")
    parser.add_argument(TRUST_FLAG, dest="trust_code", action="store_true",
                        help="a safetensors or torch model whose card's job names an entry point: import it (Python "
                             "code, from --module-path, then the model's folder; only for code you trust)")
    parser.add_argument("--module-path", action="append", default=[], metavar="DIR",
                        help=f"with {TRUST_FLAG}: a directory to import the entry point from (repeatable)")
    parser.set_defaults(func=command)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def command(args: argparse.Namespace) -> int:
    model = Path(args.model)
    if not model.is_file():
        raise ExportError(f"model file '{model}' does not exist")
    card = ModelCard.read(card_path(model))
    samples = read_samples(input_files(args.inputs), card)
    batch = list(islice(samples, PREDICT_BATCH))  # a bad input before the model
    classifier = load_classifier(card, model, trust_code=args.trust_code, module_path=args.module_path)
    right = labelled = 0
    while batch:
        x = np.stack([sample for _, sample, _ in batch])
        for (name, _, label), row in zip(batch, softmax(run_batches(classifier, x, len(card.classes))), strict=True):
            best = top_k(row, card.classes, args.top)
            if args.json:
                print(json.dumps({"input": name, "top": [{"class": c, "p": p} for c, p in best]}))
            else:
                print(f"{name}  " + ", ".join(f"{c} (p={p:.2f})" for c, p in best))
            if label is not None:
                labelled += 1
                right += best[0][0] == card.classes[label]
        batch = list(islice(samples, PREDICT_BATCH))
    if labelled:
        print(f"{right} of the {labelled} inputs that say their class predicted right ({right / labelled:.1%})",
              file=sys.stderr)
    return 0


def read_samples(files: Sequence[str], card: ModelCard) -> Iterator[Sample]:
    """Every input of ``files`` in order, read as it is reached: a CSV file's rows and an archive's samples one by
    one, any other file whole (``read_input``), each with the class it says it is (a CSV row's label; an archive's
    ``y``; a file in a folder named after a class)."""
    column = parse_job(card.job_source, origin=f"the job in model card '{card.job}'").data.label_column \
        if any(Path(name).suffix.lower() == CSV_SUFFIX for name in files) else ""
    for name in files:
        path = Path(name)
        if path.suffix.lower() == CSV_SUFFIX:
            for line, sample, label in csv_rows(path, card.input_shape, column, card.classes):
                yield f"{name}:{line}", sample, label
        elif path.suffix.lower() == ARCHIVE_SUFFIX:
            for index, sample, label in npz_samples(path, card.input_shape, card.classes):
                yield f"{name}:{index}", sample, label
        else:
            folder = path.parent.name
            yield name, read_input(path, card.input_shape), \
                card.classes.index(folder) if folder in card.classes else None


def input_files(inputs: Sequence[str]) -> list[str]:
    """The inputs as named, each folder replaced by the image and array files below it (at any depth, hidden files
    and folders left out, in name order); DataError for a folder that holds none."""
    files: list[str] = []
    for name in inputs:
        path = Path(name)
        if not path.is_dir():
            files.append(name)
            continue
        found = sorted(p for p in path.rglob("*") if p.suffix.lower() in (*IMAGE_SUFFIXES, ARRAY_SUFFIX)
                       and not any(part.startswith(".") for part in p.relative_to(path).parts) and p.is_file())
        if not found:
            raise DataError(f"folder '{path}' holds no images ({', '.join(IMAGE_SUFFIXES)}) or {ARRAY_SUFFIX} arrays")
        files += map(str, found)
    return files


def read_input(path: str | Path, input_shape: tuple[int, ...]) -> np.ndarray:
    """One sample as float32 of ``input_shape``: an image file or a ``.npy`` array; DataError naming the file."""
    source = Path(path)
    suffix = source.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        if len(input_shape) != 3:
            raise DataError(f"'{source}' is an image, but the model takes samples of shape {input_shape}; "
                            f"give {ARRAY_SUFFIX} arrays of that shape")
        return read_image(source, input_shape)
    if suffix != ARRAY_SUFFIX:
        raise DataError(f"'{source}' is neither an image ({', '.join(IMAGE_SUFFIXES)}), a {ARRAY_SUFFIX} array, a "
                        f"{CSV_SUFFIX} file nor an {ARCHIVE_SUFFIX} archive")
    try:
        array = np.load(source, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"array file '{source}' cannot be read (pickled arrays are never loaded): {exc}") from exc
    if not isinstance(array, np.ndarray):  # an .npz archive under an .npy name
        raise DataError(f"array file '{source}' holds an archive, not one array")
    if array.shape != tuple(input_shape):
        raise DataError(f"array file '{source}' has shape {array.shape}, the model takes {tuple(input_shape)}")
    if array.dtype.kind not in "iuf":
        raise DataError(f"array file '{source}' must hold numbers, got dtype {array.dtype}")
    sample = array.astype(np.float32) / np.float32(UINT8_PIXEL_MAX) if array.dtype == np.uint8 else \
        array.astype(np.float32)
    if not np.isfinite(sample).all():
        raise DataError(f"array file '{source}' holds non-finite values")
    return sample


def load_classifier(card: ModelCard, model: Path, *, trust_code: bool = False,
                    module_path: Sequence[str] = ()) -> Classifier:
    """The model in ``model`` as a function from a batch to its logits, by the card's format. An entry-point model
    (safetensors, torch) is rebuilt only with ``trust_code``, from ``module_path`` then ``model``'s folder."""
    if card.format == "onnx":
        return _onnx_classifier(model)
    return _torch_classifier(card, model, trust_code=trust_code, module_path=module_path)


def _onnx_classifier(model: Path) -> Classifier:
    try:
        import onnxruntime as ort
    except ImportError:
        raise ExportError(f"onnxruntime is not installed: {INSTALL_HINT}") from None
    try:
        session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's own exception types, whichever it raises
        raise ExportError(f"onnxruntime cannot load '{model}': {exc}") from exc
    name = session.get_inputs()[0].name

    def classify(x: np.ndarray) -> np.ndarray:
        try:
            logits: np.ndarray = session.run(None, {name: x})[0]
        except Exception as exc:  # onnxruntime's own exception types, whichever it raises
            raise ExportError(f"onnxruntime cannot run '{model}' on a batch of shape {x.shape}: {exc}") from exc
        return logits

    return classify


def _torch_classifier(card: ModelCard, model: Path, *, trust_code: bool, module_path: Sequence[str]) -> Classifier:
    """The job's model rebuilt from the card's job file (its entry point only with ``trust_code``), with the weights
    in ``model`` loaded."""
    try:
        import torch
    except ImportError:
        raise ExportError(f"'{model}' is a {card.format} file and runs on torch, which is not installed; "
                          "an ONNX export runs without it") from None

    from edgemesh.common import models
    from edgemesh.common.jobs import parse_job
    from edgemesh.operator.export import trusted_model_spec

    where = f"model card '{card_path(model)}'"
    job = parse_job(card.job_source, origin=f"job file in {where}")
    trusted_model_spec(job, trust_code=trust_code, search_path=[*module_path, str(model.parent.resolve())],
                       where=f"the job in {where}", otherwise="or predict with an ONNX export of it, which needs none")
    module = models.build_model(job.model_key)
    try:
        if card.format == "safetensors":
            from safetensors.torch import load_file

            state = load_file(model)
        else:
            state = torch.load(model, map_location="cpu", weights_only=True)
    except ImportError:
        raise ExportError(f"safetensors is not installed: {INSTALL_HINT}") from None
    except Exception as exc:  # safetensors' and torch's decoding errors
        raise ExportError(f"model file '{model}' cannot be read as {card.format}: {exc}") from exc
    try:
        module.load_state_dict(state)
    except (RuntimeError, TypeError) as exc:
        raise ExportError(f"model file '{model}' does not fit the model of its card's job: {exc}") from exc
    module.eval()

    def classify(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            logits: np.ndarray = module(torch.from_numpy(x)).numpy()
        return logits

    return classify


def run_batches(classify: Classifier, x: np.ndarray, num_classes: int) -> np.ndarray:
    """Logits of every sample in ``x``, PREDICT_BATCH at a time; ExportError unless one score per class."""
    logits = np.concatenate([classify(np.ascontiguousarray(x[i:i + PREDICT_BATCH]))
                             for i in range(0, len(x), PREDICT_BATCH)])
    if logits.shape != (len(x), num_classes):
        raise ExportError(f"the model gives outputs of shape {logits.shape[1:]}, its card names {num_classes} classes")
    return logits


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax, in float64."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    result: np.ndarray = exp / exp.sum(axis=1, keepdims=True)
    return result


def top_k(probabilities: np.ndarray, classes: Sequence[str], k: int) -> list[tuple[str, float]]:
    """The ``k`` likeliest classes with their probabilities, likeliest first (ties: lower index first)."""
    order = np.argsort(-probabilities, kind="stable")[: min(k, len(classes))]
    return [(classes[i], float(probabilities[i])) for i in order]
