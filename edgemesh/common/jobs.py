"""Training jobs: the job file (TOML), its validation, and the configuration a service runs a job with.

A job is one training run on the fleet (docs/jobs.md): a name and a stop rule (``[job]``), the model
(``[model]``: a layer list or a Python entry point), the data on each device (``[data]``), the
evaluation (``[evaluation]``: a held-out set on the parameter server's host, or each device's local
validation share) and the training settings (``[training]``, ``[planner]``, ``[ps]``, ``[compressor]``:
the service configuration's own sections, as in a service's TOML file).

:func:`parse_job` reads the file and names every problem it finds at once (:class:`JobError`); it does
not import torch, so the planner can parse jobs too. :func:`check_model` builds the model (torch), which
``edgemesh job submit`` does before publishing, as the parameter server and the workers do when they
start the job (:func:`host_model_spec`). An entry point is imported only from a module the building machine's
own ``[models]`` configuration allows, never from a directory the job names on a host. :func:`job_config` is the
configuration a service serves a job with: its own settings (broker, metrics, device, models) under the job's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Final, Literal

from edgemesh.common.config import Config, ModelsConfig
from edgemesh.common.config.loading import with_settings
from edgemesh.common.errors import ConfigError, EdgeMeshError, JobError, ModelError
from edgemesh.common.vocabulary import valid_name

if TYPE_CHECKING:
    from edgemesh.common.costs import LayerCost, ModelCost
    from edgemesh.common.models import ModelSpec
    from edgemesh.common.models.entry_point import Allowed

DataFormat = Literal["image-folder", "csv", "npz", "digits"]
DATA_FORMATS: Final[tuple[DataFormat, ...]] = ("image-folder", "csv", "npz", "digits")
"""Where a device's data comes from: its own files (the first three) or scikit-learn's digits, which
every device holds and takes its plan's shard of (for demos and tests)."""
SECTIONS: Final = ("job", "model", "data", "evaluation", "training", "planner", "ps", "compressor")
SETTING_SECTIONS: Final = ("training", "planner", "ps", "compressor")
"""Sections that set the services' configuration for this job (same keys as a service's TOML)."""
SET_BY_THE_JOB: Final = {"training.model_spec", "training.dataset", "training.dataset_path", "ps.state_dir",
                         "ps.eval_every", "ps.memory_limit_mb"}
"""Settings a job file may not give: the job sets them from its other sections, or they belong to the host (its
state, its memory budget)."""
MAX_JOB_FILE_BYTES: Final = 256 * 1024
MAX_INPUT_VALUES: Final = 2**22
"""Most values one sample may be (``model.input_shape``): 16 MiB as float32, 3 x 1182 x 1182."""
DIGITS_SHAPE: Final = (1, 8, 8)
DIGITS_CLASSES: Final = tuple(str(d) for d in range(10))
DEFAULT_EVAL_EVERY: Final = 5


@dataclass(frozen=True, slots=True)
class ModelDef:
    """``[model]``: what the network eats and predicts, and how to build it."""

    input_shape: tuple[int, ...]
    classes: tuple[str, ...]
    layers: tuple[Any, ...] = ()
    """A layer list, as written (``{conv2d = 16, kernel = 3}``, ``"relu"``, ...)."""
    entry_point: str = ""
    """``package.module:function`` returning a ``torch.nn.Module``."""
    module_path: str = ""
    """Where ``entry_point``'s module is: searched by ``edgemesh job submit`` on the operator's machine; never added
    to a host's import path (a host refuses the job unless its own ``models.path`` lists this very directory)."""


@dataclass(frozen=True, slots=True)
class DataDef:
    """``[data]``: the training data on each device, and how inputs are normalized."""

    format: DataFormat
    path: str = ""
    """The directory (image-folder) or file (csv, npz) on each device, relative to its ``worker.data_dir`` (never
    absolute, never through ``..``); unused for digits."""
    mean: tuple[float, ...] = ()
    """Per-channel (or per-feature) mean subtracted from inputs in [0, 1]; empty = none."""
    std: tuple[float, ...] = ()
    label_column: str = "label"
    """csv: the column holding class names."""
    max_samples: int = 0
    """Use at most this many of a device's samples (0 = all)."""
    partition: Literal["iid", "dirichlet"] = "iid"
    """digits: how the set is divided among devices."""
    partition_alpha: float = 0.5


@dataclass(frozen=True, slots=True)
class EvaluationDef:
    """``[evaluation]``: where the model's accuracy is measured."""

    path: str = ""
    """A held-out set on the parameter server's host, in the data's format, relative to its ``ps.data_dir``."""
    local_share: float = 0.0
    """Each device keeps this share of its data for validation and reports on it (the data never leaves)."""
    every: int = DEFAULT_EVAL_EVERY
    """Evaluate every this many model versions."""

    @property
    def local(self) -> bool:
        return self.local_share > 0


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A parsed, validated job file."""

    name: str
    model: ModelDef
    data: DataDef
    evaluation: EvaluationDef
    settings: Mapping[str, Mapping[str, Any]]
    """The ``[training]``, ``[planner]``, ``[ps]`` and ``[compressor]`` tables, as written."""
    target_accuracy: float = 0.0
    """Stop rule: end the job once the evaluated accuracy reaches this (0 = no target)."""
    max_versions: int = 0
    """Stop rule: end the job at this model version (0 = no limit)."""
    max_minutes: float = 0.0
    """Stop rule: end the job after this many minutes of running (0 = no limit)."""
    description: str = ""
    sha256: str = ""
    """Hash of the job file's text: the identity of this submission of the job."""
    source: str = field(default="", repr=False)

    @property
    def model_key(self) -> str:
        """The model's name in plans, snapshots and checkpoints: the job and its file's hash."""
        return f"{self.name}@{self.sha256[:12]}"

    @property
    def num_classes(self) -> int:
        return len(self.model.classes)


class _Errors:
    """Problems found while reading a job file, each named by its key."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, key: str, message: str) -> None:
        self.items.append(f"{key}: {message}")

    def check(self, ok: bool, key: str, message: str) -> bool:
        if not ok:
            self.add(key, message)
        return ok


def parse_job(text: str | bytes, *, origin: str = "job file") -> JobSpec:
    """Read and validate a job file; :class:`JobError` lists every problem (each named by its key). A job file comes
    from the network: nothing else escapes, not a file nested too deeply for the TOML reader, nor one that trips a
    check in a way no rule foresaw."""
    try:
        return _read_job(text, origin)
    except JobError:
        raise
    except RecursionError:
        raise JobError(origin, ["not valid TOML: its lists and tables nest too deeply"]) from None
    except Exception as exc:  # a last resort: the problem is named, the file refused
        raise JobError(origin, [f"cannot be read: {type(exc).__name__}: {str(exc)[:200]}"]) from None


def _read_job(text: str | bytes, origin: str) -> JobSpec:
    """:func:`parse_job`, but for its last resort."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    if len(raw) > MAX_JOB_FILE_BYTES:
        raise JobError(origin, [f"the file is larger than {MAX_JOB_FILE_BYTES} bytes"])
    try:
        source = raw.decode("utf-8")
        tree = tomllib.loads(source)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise JobError(origin, [f"not valid TOML: {exc}"]) from None
    errors = _Errors()
    for section in tree:
        errors.check(section in SECTIONS, f"[{section}]", f"unknown section; known: {', '.join(SECTIONS)}")
    job = _table(tree, "job", errors)
    name = job.get("name")
    errors.check(isinstance(name, str) and valid_name(name), "job.name",
                 f"{name!r}: give 1-64 characters of A-Z a-z 0-9 _ . - (it names the job's MQTT topics)")
    _known_keys(job, "job", ("name", "description", "target_accuracy", "max_versions", "max_minutes"), errors)
    target = _number(job, "job", "target_accuracy", 0.0, errors, low=0.0, high=1.0)
    max_versions = _integer(job, "job", "max_versions", 0, errors)
    max_minutes = _number(job, "job", "max_minutes", 0.0, errors, low=0.0)
    data = _data(_table(tree, "data", errors), errors)
    model = _model(_table(tree, "model", errors), data, errors)
    evaluation = _evaluation(_table(tree, "evaluation", errors), data, errors)
    settings = {s: dict(_table(tree, s, errors)) for s in SETTING_SECTIONS}
    for section, values in settings.items():
        for key in values:
            errors.check(f"{section}.{key}" not in SET_BY_THE_JOB, f"{section}.{key}",
                         "set by the job itself (from [model], [data], [evaluation]) or by the host; remove it")
    for section, values in settings.items():
        try:
            own = {k: v for k, v in values.items() if f"{section}.{k}" not in SET_BY_THE_JOB}
            with_settings(Config(), {section: own})
        except ConfigError as exc:
            errors.items.append(str(exc))  # it names its key
    if errors.items:
        raise JobError(origin, errors.items)
    assert isinstance(name, str) and model is not None and data is not None and evaluation is not None
    return JobSpec(name=name, model=model, data=data, evaluation=evaluation, settings=settings,
                   target_accuracy=target, max_versions=max_versions, max_minutes=max_minutes,
                   description=str(job.get("description", "")), sha256=hashlib.sha256(raw).hexdigest(),
                   source=source)


def read_job_file(path: str | Path) -> JobSpec:
    """:func:`parse_job` of a file; a file that cannot be read is a JobError naming it."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise JobError(str(path), [f"cannot read it: {exc.strerror or exc}"]) from None
    return parse_job(raw, origin=str(path))


def _table(tree: Mapping[str, Any], section: str, errors: _Errors) -> Mapping[str, Any]:
    value = tree.get(section, {})
    if not isinstance(value, Mapping):
        errors.add(f"[{section}]", "must be a table")
        return {}
    return value


def _known_keys(table: Mapping[str, Any], section: str, known: Sequence[str], errors: _Errors) -> None:
    for key in table:
        errors.check(key in known, f"{section}.{key}", f"unknown key; known: {', '.join(known)}")


def _number(table: Mapping[str, Any], section: str, key: str, default: float, errors: _Errors, *,
            low: float | None = None, high: float | None = None) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
        errors.add(f"{section}.{key}", f"expected a number, got {value!r}")
        return default
    if (low is not None and value < low) or (high is not None and value > high):
        errors.add(f"{section}.{key}", f"{value} is outside [{low}, {high if high is not None else 'inf'}]")
        return default
    return float(value)


def _integer(table: Mapping[str, Any], section: str, key: str, default: int, errors: _Errors, *,
             low: int = 0) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        errors.add(f"{section}.{key}", f"expected an integer >= {low}, got {value!r}")
        return default
    return value


def _finite(value: float) -> bool:
    """A float, or an int a float holds (TOML integers have no bound; ``math.isfinite`` overflows on a huge one)."""
    return abs(value) <= sys.float_info.max


def _relative_path(path: str, key: str, errors: _Errors) -> None:
    """A job's data path is relative to each host's data folder (``worker.data_dir``, ``ps.data_dir``): never
    absolute, never through ``..`` (each host checks again where it leads, links included)."""
    parts = PurePosixPath(path).parts
    if "\0" in path:
        errors.add(key, "holds a NUL character")
    elif PurePosixPath(path).is_absolute() or ".." in parts:
        errors.add(key, f"{path[:200]!r} must be a path relative to each host's data folder (worker.data_dir, "
                        "ps.data_dir), without '..'")


def _floats(table: Mapping[str, Any], section: str, key: str, errors: _Errors) -> tuple[float, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, int | float) and not isinstance(v, bool)
                                              and _finite(v) for v in value):
        errors.add(f"{section}.{key}", f"expected a list of numbers, got {value!r}")
        return ()
    return tuple(float(v) for v in value)


def _data(table: Mapping[str, Any], errors: _Errors) -> DataDef | None:
    _known_keys(table, "data", ("format", "path", "mean", "std", "label_column", "max_samples", "partition",
                                "partition_alpha"), errors)
    fmt = next((f for f in DATA_FORMATS if f == table.get("format")), None)
    if fmt is None:
        errors.add("data.format", f"{table.get('format')!r} is not one of {', '.join(DATA_FORMATS)}")
        return None
    path = table.get("path", "")
    if errors.check(isinstance(path, str), "data.path", "expected a string") and path:
        _relative_path(path, "data.path", errors)
    errors.check(fmt == "digits" or bool(path), "data.path", f"format {fmt!r} needs the data's path on each device")
    mean, std = _floats(table, "data", "mean", errors), _floats(table, "data", "std", errors)
    errors.check(len(mean) == len(std), "data.std", f"give as many values as data.mean ({len(mean)}), got {len(std)}")
    errors.check(all(s > 0 for s in std), "data.std", "every value must be > 0")
    label = table.get("label_column", "label")
    errors.check(isinstance(label, str) and bool(label), "data.label_column", "expected a column name")
    partition = table.get("partition", "iid")
    errors.check(partition in ("iid", "dirichlet"), "data.partition", f"{partition!r} is not iid or dirichlet")
    alpha = _number(table, "data", "partition_alpha", 0.5, errors, low=1e-6)
    return DataDef(format=fmt, path=str(path), mean=mean, std=std, label_column=str(label),
                   max_samples=_integer(table, "data", "max_samples", 0, errors),
                   partition=partition if partition in ("iid", "dirichlet") else "iid", partition_alpha=alpha)


def _model(table: Mapping[str, Any], data: DataDef | None, errors: _Errors) -> ModelDef | None:
    _known_keys(table, "model", ("input_shape", "classes", "layers", "entry_point", "module_path"), errors)
    shape = table.get("input_shape")
    shape_ok = errors.check(
        isinstance(shape, list) and 1 <= len(shape) <= 4
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape),
        "model.input_shape", f"expected 1 to 4 positive integers ([channels, height, width] or [features]), "
        f"got {shape!r}")
    values = math.prod(shape) if shape_ok and isinstance(shape, list) else 0
    if values > MAX_INPUT_VALUES:
        shape_ok = errors.check(False, "model.input_shape", f"{shape} is {values:,} values per sample, more than the "
                                f"{MAX_INPUT_VALUES:,} a job may give")
    classes = table.get("classes")
    classes_ok = errors.check(
        isinstance(classes, list) and len(classes) >= 2 and all(isinstance(c, str) and c for c in classes)
        and len(set(classes)) == len(classes),
        "model.classes", f"expected a list of at least 2 distinct class names, got {classes!r}")
    layers, entry = table.get("layers"), table.get("entry_point")
    errors.check((layers is None) != (entry is None), "model", "give exactly one of layers or entry_point")
    errors.check(layers is None or (isinstance(layers, list) and bool(layers)), "model.layers",
                 "expected a non-empty list of layers")
    errors.check(entry is None or (isinstance(entry, str) and ":" in entry), "model.entry_point",
                 f"expected 'package.module:function', got {entry!r}")
    module_path = table.get("module_path", "")
    errors.check(isinstance(module_path, str), "model.module_path", "expected a directory")
    if not (shape_ok and classes_ok):
        return None
    assert isinstance(shape, list) and isinstance(classes, list)
    if data is not None:
        if data.format == "digits":
            errors.check(tuple(shape) == DIGITS_SHAPE, "model.input_shape",
                         f"digits images are {list(DIGITS_SHAPE)}, got {shape}")
            errors.check(tuple(classes) == DIGITS_CLASSES, "model.classes",
                         f"digits classes are {list(DIGITS_CLASSES)}")
        if data.format == "image-folder":
            errors.check(len(shape) == 3 and shape[0] in (1, 3), "model.input_shape",
                         f"images are [channels (1 or 3), height, width], got {shape}")
        if data.mean:
            errors.check(len(data.mean) in (1, shape[0]), "data.mean",
                         f"give one value or one per channel ({shape[0]}), got {len(data.mean)}")
    return ModelDef(input_shape=tuple(shape), classes=tuple(classes),
                    layers=tuple(layers) if isinstance(layers, list) else (),
                    entry_point=entry if isinstance(entry, str) else "", module_path=str(module_path))


def _evaluation(table: Mapping[str, Any], data: DataDef | None, errors: _Errors) -> EvaluationDef | None:
    _known_keys(table, "evaluation", ("path", "local_share", "every"), errors)
    path = table.get("path", "")
    if errors.check(isinstance(path, str), "evaluation.path", "expected a path on the parameter server's host") \
            and path:
        _relative_path(path, "evaluation.path", errors)
    share = _number(table, "evaluation", "local_share", 0.0, errors, low=0.0, high=0.9)
    every = _integer(table, "evaluation", "every", DEFAULT_EVAL_EVERY, errors, low=1)
    if data is not None and data.format != "digits":
        errors.check(bool(path) != (share > 0), "evaluation",
                     "give exactly one of path (a held-out set on the parameter server's host) or local_share "
                     "(each device's own validation share)")
    return EvaluationDef(path=str(path), local_share=share, every=every)


# --------------------------------------------------------------------------- the model


def model_spec(job: JobSpec, *, allowed: Allowed = (), search_path: Sequence[str] = ()) -> ModelSpec:
    """The job's model as a registered ``models.ModelSpec`` named ``job.model_key`` (imports torch). An entry point
    is imported only from a module ``allowed`` allows (none by default), found on ``search_path`` first; the job's
    own ``model.module_path`` is searched only where the caller puts it in ``search_path``.

    ModelError (naming the layer, or the entry point) when it does not build or is not allowed.
    """
    from edgemesh.common import models

    m, d = job.model, job.data
    mean, std = _per_channel(d.mean, m.input_shape), _per_channel(d.std, m.input_shape)
    if m.entry_point:
        spec = models.entry_point_spec(job.model_key, m.entry_point, m.input_shape, job.num_classes, mean=mean,
                                       std=std, allowed=allowed, search_path=[p for p in search_path if p])
    else:
        spec = models.layer_list_spec(job.model_key, list(m.layers), m.input_shape, job.num_classes, mean=mean,
                                      std=std, description=job.description)
    models.register_spec(spec)
    return spec


def host_model_spec(job: JobSpec, models: ModelsConfig) -> ModelSpec:
    """The job's model as a host builds it (the parameter server, a worker): an entry point only from a module the
    host's ``models.allowed`` allows, found on its ``models.path``. ModelError, before anything is imported, for a
    module it does not allow and for a job whose ``model.module_path`` is not one of the host's ``models.path``:
    a job may not add a directory to a host's import path."""
    from edgemesh.common.models.entry_point import check_allowed

    m = job.model
    if m.entry_point:
        check_allowed(m.entry_point, models.allowed)
        if m.module_path and os.path.normpath(m.module_path) not in {os.path.normpath(p) for p in models.path}:
            listed = ", ".join(repr(p) for p in models.path) or "none"
            raise ModelError(f"entry point {m.entry_point!r}: model.module_path {m.module_path!r} is not one of this "
                             f"host's models.path ({listed}); a job cannot add a directory to a host's import path: "
                             "install the module, or list its directory in the host's models.path")
    return model_spec(job, allowed=models.allowed, search_path=models.path)


def _per_channel(values: tuple[float, ...], shape: tuple[int, ...]) -> tuple[float, ...]:
    """One value per channel: a single value stands for every channel."""
    return values * shape[0] if len(values) == 1 else values


def check_model(job: JobSpec, *, search_path: Sequence[str] = (),
                trust: ModelsConfig | None = None) -> tuple[ModelCost, tuple[LayerCost, ...] | None, str]:
    """Build the job's model and derive its costs, registered under ``job.model_key``: (cost, divisible layers
    or None, why model parallelism cannot divide it or ''). JobError naming the model when it does not build.

    As ``edgemesh job submit`` does on the operator's machine: an entry point only from a module ``trust.allowed``
    allows (the operator's own ``[models]``; none by default), looked for on ``search_path``, the job's
    ``model.module_path`` and ``trust.path``."""
    from edgemesh.common import costs, models

    own = trust or ModelsConfig()
    try:
        spec = model_spec(job, allowed=own.allowed, search_path=[*search_path, job.model.module_path, *own.path])
        module = models.build_model(spec.name, seed=_seed(job))
        cost, layers = models.derive_costs(module, spec.input_shape)
    except EdgeMeshError as exc:
        raise JobError(job.name, [f"model: {exc}"]) from None
    except Exception as exc:  # torch's own errors (an allocation, an overflow): the job is refused, not a traceback
        raise JobError(job.name, [f"model: does not build: {type(exc).__name__}: {str(exc)[:200]}"]) from None
    refusal = ""
    try:
        models.mesh_stages(module)
    except EdgeMeshError as exc:
        refusal = str(exc)
    costs.register(job.model_key, cost, layers)
    return cost, layers, refusal


def _seed(job: JobSpec) -> int:
    seed = job.settings.get("training", {}).get("seed", 0)
    return seed if isinstance(seed, int) else 0


def render_job(tree: Mapping[str, Mapping[str, Any]]) -> str:
    """A job file's text from its tables (strings, numbers, booleans, lists and inline tables of them)."""
    lines: list[str] = []
    for section, table in tree.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml(value)}" for key, value in table.items())
        lines.append("")
    return "\n".join(lines)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} to a job file")


# --------------------------------------------------------------------------- configuration


def run_name(job: JobSpec, submitted_at: float) -> str:
    """One run of a job (a submission): the directory of its parameter server's state under the job's."""
    return f"{int(submitted_at * 1000)}-{job.sha256[:12]}"


def job_config(base: Config, job: JobSpec, run: str = "") -> Config:
    """The configuration a service serves ``job`` with: ``base`` (the host's own: broker, metrics,
    device, state directory) under the job's settings, its name as the topic namespace; the PS state of
    run ``run`` (:func:`run_name`) in ``{ps.state_dir}/{job}/{run}``."""
    tree: dict[str, dict[str, Any]] = {s: dict(v) for s, v in job.settings.items()}
    training = tree.setdefault("training", {})
    training.update(model_spec=job.model_key, dataset=job.data.format, dataset_path=job.data.path,
                    partition=job.data.partition, partition_alpha=job.data.partition_alpha)
    ps = tree.setdefault("ps", {})
    ps.update(state_dir=str(Path(base.ps.state_dir) / job.name / run), eval_every=job.evaluation.every)
    cfg = with_settings(base, tree)
    return dataclasses.replace(cfg, job=job.name)
