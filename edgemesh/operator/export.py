"""A trained model as a file for use outside the fleet (ONNX, safetensors or torch) and its model card.

``edgemesh job export`` rebuilds the job's module, loads the final snapshot into it and calls
:func:`export_model`, :func:`check_onnx` (for ONNX) and :func:`write_card`; ``edgemesh predict``
reads the card back with :meth:`ModelCard.read`. The functions do no MQTT and no logging setup.

The ONNX file is exported with torch's TorchScript-based exporter (``dynamo=False``: it needs no
onnxscript), in eval mode and without autograd, so ``LeanReLU`` and ``LeanMaxPool2d`` take their
plain ``torch.relu`` / ``nn.MaxPool2d`` path and the graph holds standard operators only; its batch
dimension is dynamic, its input is named ``input`` and its output ``logits``. The safetensors and
torch files hold the state dict: parameters and buffers (a ``Standardize`` first layer's ``mean``
and ``std``), as contiguous float32 copies.

torch, onnx, onnxruntime and safetensors are imported inside the functions that need them, so a
host that only runs ONNX inference reads cards without torch.

A job's entry point is Python code: ``export`` and ``predict`` rebuild an entry-point model only when the user
passes ``--trust-code`` (:func:`trusted_model_spec`); a layer list needs no code, an ONNX file none at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import math
import os
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

from edgemesh.common.errors import ExportError

if TYPE_CHECKING:
    import torch

    from edgemesh.common.jobs import JobSpec
    from edgemesh.common.models import ModelSpec

EXPORT_FORMATS: Final = ("onnx", "safetensors", "torch")
"""What ``export_model`` writes: an ONNX graph, or the state dict as safetensors or a torch file."""
ONNX_OPSET: Final = 17
ONNX_INPUT: Final = "input"
ONNX_OUTPUT: Final = "logits"
ONNX_BATCH_AXIS: Final = "batch"
STANDARD_ONNX_DOMAINS: Final = ("", "ai.onnx")
"""Operator domains onnxruntime runs everywhere; anything else (a PythonOp of an autograd function) is refused."""
TRACE_BATCH: Final = 2
"""Batch size of the sample the exporter traces with (not 1, so nothing specializes on a single sample)."""
CARD_SUFFIX: Final = ".card.json"
INSTALL_HINT: Final = "pip install 'edgemesh[export]'"
TRUST_FLAG: Final = "--trust-code"


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What a model file is and how to use it, written beside it as ``<model file>.card.json``."""

    job: str
    classes: tuple[str, ...]
    """Class names; the model's output ``i`` scores ``classes[i]``."""
    input_shape: tuple[int, ...]
    """Shape of one sample: (C, H, W) for images, (F,) for feature vectors."""
    mean: tuple[float, ...]
    """Per-channel mean the model subtracts itself (inputs in [0, 1]); empty when it standardizes nothing."""
    std: tuple[float, ...]
    """Per-channel std the model divides by itself; empty when it standardizes nothing."""
    accuracy: float | None
    """Evaluated accuracy of this version, if the job evaluated it."""
    version: int
    """Model version of the snapshot exported."""
    job_sha256: str
    format: str
    """One of EXPORT_FORMATS."""
    file: str
    """The model file's name (no directory)."""
    model_key: str
    exported_at: float
    """Unix time of the export."""
    job_source: str
    """The job file's TOML text, so the model can be rebuilt (``parse_job`` then ``model_spec``)."""

    def __post_init__(self) -> None:
        problems = _card_problems(self)
        if problems:
            raise ExportError("invalid model card: " + "; ".join(problems))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, origin: str = "model card") -> ModelCard:
        """The card in ``text``; ExportError naming ``origin`` and each field at fault."""
        try:
            tree = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ExportError(f"{origin} is not valid JSON: {exc}") from None
        if not isinstance(tree, dict):
            raise ExportError(f"{origin} holds {type(tree).__name__}, not a JSON object")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [name for name in names if name not in tree]
        if missing:
            raise ExportError(f"{origin} lacks {', '.join(missing)}")
        # Lists become tuples; unknown keys (from a newer edgemesh) are ignored.
        values: dict[str, Any] = {name: tuple(v) if isinstance(v := tree[name], list) else v for name in names}
        try:
            return cls(**values)
        except ExportError as exc:
            raise ExportError(f"{origin}: {exc}") from None

    @classmethod
    def read(cls, path: str | Path) -> ModelCard:
        """The card in the file ``path``; ExportError naming it when it is missing or malformed."""
        try:
            text = Path(path).read_bytes()
        except FileNotFoundError:
            raise ExportError(f"model card '{path}' does not exist (it is written beside the model file by "
                              "'edgemesh job export')") from None
        except OSError as exc:
            raise ExportError(f"model card '{path}' cannot be read: {exc}") from None
        return cls.from_json(text, origin=f"model card '{path}'")


def _card_problems(card: ModelCard) -> list[str]:
    """What is wrong with ``card``'s fields, each named; empty when nothing is."""
    problems: list[str] = []

    def check(ok: bool, name: str, expected: str) -> None:
        if not ok:
            problems.append(f"{name} must be {expected}, got {getattr(card, name)!r}")

    for name in ("job", "job_sha256", "file", "model_key", "job_source"):
        check(isinstance(getattr(card, name), str), name, "a string")
    check(isinstance(card.classes, tuple) and bool(card.classes) and all(isinstance(c, str) for c in card.classes),
          "classes", "a non-empty list of strings")
    check(isinstance(card.input_shape, tuple) and bool(card.input_shape) and all(_positive_int(d) for d in
                                                                                 card.input_shape),
          "input_shape", "a non-empty list of positive integers")
    for name in ("mean", "std"):
        check(isinstance(getattr(card, name), tuple) and all(_finite(v) for v in getattr(card, name)), name,
              "a list of numbers")
    check(len(card.mean) == len(card.std), "std", f"as long as mean ({len(card.mean)} values)")
    check(card.accuracy is None or (_finite(card.accuracy) and 0.0 <= card.accuracy <= 1.0), "accuracy",
          "null or a number in [0, 1]")
    check(isinstance(card.version, int) and not isinstance(card.version, bool) and card.version >= 0, "version",
          "an integer >= 0")
    check(card.format in EXPORT_FORMATS, "format", f"one of {', '.join(EXPORT_FORMATS)}")
    check(_finite(card.exported_at), "exported_at", "a number (Unix time)")
    return problems


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def card_path(model_path: str | Path) -> Path:
    """Where the card of ``model_path`` lives: beside it, ``shapes.onnx`` -> ``shapes.onnx.card.json``."""
    path = Path(model_path)
    return path.with_name(path.name + CARD_SUFFIX)


def write_card(card: ModelCard, model_path: Path) -> Path:
    """Write ``card`` beside ``model_path`` (see :func:`card_path`) and return the card's path."""
    path = card_path(model_path)
    _write_atomically(path, card.to_json().encode("utf-8"))
    return path


def trusted_model_spec(job: JobSpec, *, trust_code: bool, search_path: Sequence[str], where: str,
                       otherwise: str) -> ModelSpec:
    """The job's model registered, as ``export`` and ``predict`` rebuild it: a layer list always; an entry point
    only when ``trust_code`` (the user passed ``--trust-code``), then whatever module it names, imported from
    ``search_path`` first. Without it, ExportError naming the entry point and the flag, then ``otherwise`` (what the
    user can do instead, if anything), before anything is imported. ``where`` names the job's origin (a job on the
    broker, a model card)."""
    from edgemesh.common.jobs import model_spec
    from edgemesh.common.models.entry_point import ANY_MODULE

    if job.model.entry_point and not trust_code:
        raise ExportError(f"{where} builds its model with the entry point {job.model.entry_point!r}, which is Python "
                          f"code, and nothing is imported without {TRUST_FLAG}: pass {TRUST_FLAG} if you trust that "
                          "code (with --module-path DIR where its module is)" + (f"; {otherwise}" if otherwise else ""))
    return model_spec(job, allowed=ANY_MODULE if trust_code else (), search_path=search_path)


def normalization(module: torch.nn.Module) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The per-channel (mean, std) the model applies itself: its first layer's when that is a
    ``Standardize``, else two empty tuples (the model takes its inputs as they come)."""
    from edgemesh.common.models import Standardize

    first = next((m for m in module.modules() if not list(m.children())), None)
    if not isinstance(first, Standardize):
        return (), ()
    return tuple(first.mean.flatten().tolist()), tuple(first.std.flatten().tolist())


def export_model(module: torch.nn.Module, input_shape: tuple[int, ...], fmt: str, out: str | Path) -> Path:
    """Write ``module`` (taking samples of ``input_shape``) to ``out`` as ``fmt``; the path written.

    The file appears whole or not at all (written beside, then renamed). ExportError for an unknown
    format, a bad input shape, a path that cannot be written (its directory must exist), a missing
    optional package or a model the exporter cannot convert. The module's train/eval mode is restored.
    """
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; known: {', '.join(EXPORT_FORMATS)}")
    if not isinstance(input_shape, tuple) or not input_shape or not all(_positive_int(d) for d in input_shape):
        raise ExportError(f"input_shape must be a non-empty tuple of positive integers, got {input_shape!r}")
    path = Path(out)
    _check_writable(path)
    if fmt == "onnx":
        data = _onnx_bytes(module, input_shape)
    elif fmt == "safetensors":
        safetensors_torch = _optional("safetensors.torch", "safetensors")
        data = safetensors_torch.save(_state_dict(module), metadata={"format": "pt"})
    else:
        import torch

        buffer = io.BytesIO()
        torch.save(_state_dict(module), buffer)
        data = buffer.getvalue()
    _write_atomically(path, data)
    return path


def check_onnx(module: torch.nn.Module, input_shape: tuple[int, ...], onnx_path: str | Path, *, samples: int = 4,
               seed: int = 0) -> float:
    """Largest |onnxruntime logits - torch logits| over ``samples`` random inputs in [0, 1] (seeded).

    ExportError when onnxruntime is missing, cannot load the file, or the outputs differ in shape.
    """
    import numpy as np
    import torch

    ort = _optional("onnxruntime", "onnxruntime")
    x = np.random.default_rng(seed).random((samples, *input_shape), dtype=np.float32)
    try:
        session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        (got,) = session.run([ONNX_OUTPUT], {ONNX_INPUT: x})
    except Exception as exc:  # onnxruntime's own exception types, whichever it raises
        raise ExportError(f"onnxruntime cannot run '{onnx_path}': {exc}") from exc
    was_training = module.training
    try:
        module.eval()
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
    finally:
        module.train(was_training)
    if got.shape != want.shape:
        raise ExportError(f"'{onnx_path}' gives logits of shape {got.shape}, the torch model {want.shape}")
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))


def _onnx_bytes(module: torch.nn.Module, input_shape: tuple[int, ...]) -> bytes:
    """``module`` as a serialized ONNX model, checked with onnx: valid, standard operators only."""
    import torch

    onnx = _optional("onnx", "onnx")
    export = torch.onnx.export
    options: dict[str, Any] = {}
    if "dynamo" in inspect.signature(export).parameters:
        options["dynamo"] = False  # the TorchScript exporter, the default before torch 2.9; needs no onnxscript
    sample = torch.rand((TRACE_BATCH, *input_shape), generator=torch.Generator().manual_seed(0))
    was_training = module.training
    try:
        module.eval()
        with tempfile.TemporaryDirectory(prefix="edgemesh-export-") as scratch, torch.no_grad(), \
                warnings.catch_warnings():
            # torch >= 2.9 warns that the TorchScript exporter is deprecated; it is still the one without onnxscript
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            traced = Path(scratch, "model.onnx")
            export(module, (sample,), traced, input_names=[ONNX_INPUT], output_names=[ONNX_OUTPUT],
                   opset_version=ONNX_OPSET, dynamic_axes={ONNX_INPUT: {0: ONNX_BATCH_AXIS},
                                                           ONNX_OUTPUT: {0: ONNX_BATCH_AXIS}}, **options)
            data = traced.read_bytes()
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ExportError(f"torch cannot export the model to ONNX: {exc}") from exc
    except OSError as exc:
        raise ExportError(f"cannot export to ONNX through a temporary file: {exc}") from exc
    finally:
        module.train(was_training)
    try:
        graph = onnx.load_from_string(data)
        onnx.checker.check_model(graph)
    except Exception as exc:  # onnx's checker and decoder errors
        raise ExportError(f"the exported ONNX model is invalid: {exc}") from exc
    foreign = sorted({f"{n.domain}::{n.op_type}" for n in graph.graph.node if n.domain not in STANDARD_ONNX_DOMAINS})
    if foreign:
        raise ExportError(f"the exported ONNX graph holds non-standard operators {', '.join(foreign)} "
                          "(a custom autograd function?)")
    return bytes(data)


def _state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers as detached, contiguous CPU copies (no shared storage: safetensors refuses it)."""
    return {name: value.detach().to("cpu").contiguous().clone() for name, value in module.state_dict().items()}


def _optional(module: str, package: str) -> ModuleType:
    """Import ``module`` of the optional ``package``; ExportError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ExportError(f"{package} is not installed: {INSTALL_HINT}") from None


def _check_writable(path: Path) -> None:
    if path.is_dir():
        raise ExportError(f"cannot write '{path}': it is a directory")
    if not path.parent.is_dir():
        raise ExportError(f"cannot write '{path}': directory '{path.parent}' does not exist")


def _write_atomically(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a temporary file beside it, so no reader sees half a file."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    except OSError as exc:
        raise ExportError(f"cannot write '{path}': {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
