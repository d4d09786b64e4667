"""A user's own job on the simulated fleet (``edgemesh simulate --job JOB.toml``): its model, its settings and its
data, before anything is submitted.

* The model is built as a host builds it (``jobs.host_model_spec``: a layer list, or an entry point the host's
  ``[models]`` allows), so its FLOPs set every board's step time and its real gradients train.
* The job's ``[training]``, ``[planner]``, ``[ps]`` and ``[compressor]`` tables are its settings (``jobs.job_config``,
  as the services serve it); ``--set`` goes over them, and the run's policy, seed and learning rate over that.
* Its data is read on this machine as a device reads its own (``load_local``), from the job's ``data.path`` under
  ``data_dir``; the simulated devices split it as the plan's partition says (a fleet whose devices hold different
  data trains on those devices' data, which this machine does not have: the split stands in for it). The held-out
  set is the job's ``evaluation.path`` under the same folder, else a fifth of the data held out per class.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edgemesh.common.config import Config, load_config, with_settings
from edgemesh.common.data import Dataset, load_dataset, load_local
from edgemesh.common.errors import DataError
from edgemesh.common.jobs import JobSpec, host_model_spec, job_config, read_job_file

HELD_OUT_SHARE = 0.2
"""The share of the job's data held out for evaluation when the job names no ``evaluation.path``."""


@functools.lru_cache(maxsize=4)
def read(job_file: str) -> JobSpec:
    """The job file parsed (once per file and run of the command; JobError names what is wrong)."""
    return read_job_file(job_file)


def config(job_file: str, overrides: dict[str, str], run: dict[str, dict[str, object]]) -> Config:
    """The configuration the services would serve the job with on this host, then ``overrides`` (``--set``) over
    the job's settings, then the run's (``run``: policy, seed, learning rate); the job's model built once to be
    sure it builds here (ModelError, JobError)."""
    spec = read(job_file)
    given = tree(overrides)
    for section, values in run.items():
        given.setdefault(section, {}).update(values)
    cfg = with_settings(job_config(load_config(env={}, overrides=overrides), spec), given)
    host_model_spec(spec, cfg.models)  # registers the model under the job's key
    return cfg


def tree(dotted: Mapping[str, str]) -> dict[str, Any]:
    """``{"ps.adaptive.slack": "1"}`` as the nested tables a TOML file would give: ``{"ps": {"adaptive": ...}}``."""
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        *path, name = key.split(".")
        table = out
        for part in path:
            table = table.setdefault(part, {})
        table[name] = value
    return out


@functools.lru_cache(maxsize=2)
def data(job_file: str, data_dir: str, seed: int) -> tuple[Dataset, Dataset]:
    """(train, held-out) of the job: its own data from ``data_dir`` (DataError names a missing or broken file)."""
    spec = read(job_file)
    d, m = spec.data, spec.model
    if d.format == "digits":
        return load_dataset("digits", None, seed=seed)
    share = 0.0 if spec.evaluation.path else HELD_OUT_SHARE
    try:
        local = load_local(d.format, d.path, data_dir=Path(data_dir), input_shape=m.input_shape, classes=m.classes,
                           validation_share=share, seed=seed, label_column=d.label_column, max_samples=d.max_samples)
        if spec.evaluation.path:
            held_out = load_local(d.format, spec.evaluation.path, data_dir=Path(data_dir),
                                  input_shape=m.input_shape, classes=m.classes, label_column=d.label_column).train
            return local.train, held_out
    except DataError as exc:
        where = Path(data_dir or ".").resolve()
        raise DataError(f"the job's data, read here from {where} (--data-dir): {exc}") from None
    assert local.validation is not None
    return local.train, local.validation
