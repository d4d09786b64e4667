"""Job files never end in a traceback: whatever a job file holds, ``edgemesh job submit`` and the hosts that take it
either accept it or refuse it with an EdgeMeshError naming the problem.

Hypothesis draws job files (derandomized: the same every run) around a valid one: layer lists of every kind of
layer with options in and out of range, residual blocks nested past their limit, huge widths, kernels and layer
counts, input shapes and classes of every type and size, unicode, data and evaluation paths that are absolute, go
through ``..`` or hold a NUL, settings of the wrong type or unknown; and raw text: lists and tables nested hundreds
deep, random unicode, bytes that are not UTF-8. Each goes through the operator's path (``prepare``: the file read,
parsed, its model built and its costs derived) and the hosts' (``parse_job`` of the submission's bytes, then
``host_model_spec``, the model as the parameter server and the workers build it), and may raise nothing but an
EdgeMeshError. The reproductions of the issue (a RecursionError, a RuntimeError of torch's allocator) come first,
through the ``edgemesh job submit --check`` command itself.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from edgemesh import cli
from edgemesh.common.config import ModelsConfig
from edgemesh.common.errors import EdgeMeshError, JobError
from edgemesh.common.jobs import MAX_JOB_FILE_BYTES, host_model_spec, parse_job, render_job
from edgemesh.common.models.layer_list import ACTIVATIONS, KINDS, MAX_KERNEL, MAX_LAYERS, MAX_WIDTH
from edgemesh.operator.job import prepare

EXAMPLES = 150
"""Job files drawn around a valid one (most build a model: a few tenths of a second each)."""
RAW_EXAMPLES = 60
"""Raw texts drawn (most are refused while parsing)."""
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

BASE: dict[str, dict[str, Any]] = {
    "job": {"name": "fuzz", "max_versions": 100},
    "model": {"input_shape": [3, 16, 16], "classes": ["a", "b"],
              "layers": [{"conv2d": 4, "kernel": 3, "padding": 1}, "relu", "flatten", {"linear": 2}]},
    "data": {"format": "npz", "path": "d.npz"},
    "evaluation": {"local_share": 0.2},
}
"""A valid job: each drawn file changes some of it."""


# --------------------------------------------------------------------------- strategies

INTS = st.one_of(st.integers(-3, 40), st.sampled_from([0, 1, 2**31, 2**63 - 1, -(2**63), 2**70, MAX_WIDTH,
                                                       MAX_WIDTH + 1, MAX_KERNEL, MAX_KERNEL + 1]))
"""Integers a layer's value or option may be: small, at the bounds, beyond a 64-bit integer."""
TEXT = st.text(max_size=12)
SCALARS = st.one_of(INTS, st.booleans(), st.floats(), TEXT)
"""Any TOML scalar: NaN and infinities among the floats, unicode among the strings."""
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(["a", "kernel", "residual", "linear"]), inner, max_size=3), max_leaves=8)
"""Any TOML value, a few levels deep."""
KIND_NAMES = st.sampled_from([*KINDS, "relux", "Conv2d", ""])
OPTIONS = st.dictionaries(st.sampled_from(["kernel", "padding", "stride", "groups", "bias", "activation", "kernal"]),
                          st.one_of(INTS, st.booleans(), st.sampled_from(ACTIVATIONS), VALUES), max_size=3)


def _table(kind: str, value: Any, options: dict[str, Any]) -> dict[str, Any]:
    return {kind: value, **options}


LEAF_LAYERS = st.one_of(
    KIND_NAMES,
    st.builds(_table, KIND_NAMES, st.one_of(INTS, st.floats(0, 1), VALUES), OPTIONS),
    st.builds(_table, st.sampled_from(["conv2d"]), st.integers(1, 2048), st.fixed_dictionaries(
        {"kernel": st.integers(1, 9)}, optional={"padding": st.integers(0, 4), "stride": st.integers(1, 3),
                                                 "groups": st.integers(1, 4), "bias": st.booleans()})),
    st.builds(_table, st.sampled_from(["linear"]), st.integers(1, 5000), st.just({})),
    VALUES,
)
"""One layer as a job file could write it: mostly layers the list knows, with values and options in range or not."""
LAYERS = st.recursive(LEAF_LAYERS, lambda inner: st.builds(
    lambda body, act: {"residual": body, **act}, st.lists(inner, max_size=4),
    st.one_of(st.just({}), st.builds(lambda a: {"activation": a}, st.sampled_from([*ACTIVATIONS, "gelu"])))),
    max_leaves=12)
WIDTHS = st.one_of(st.integers(1, 48), st.sampled_from([MAX_WIDTH, MAX_WIDTH + 1, 2**31, 10**8]))
"""Channels and features: mostly small, some at or past the bound."""
CONV = st.builds(lambda width, kernel, padding, stride: {"conv2d": width, "kernel": kernel, "padding": padding,
                                                         "stride": stride},
                 WIDTHS, st.one_of(st.integers(1, 3), st.sampled_from([MAX_KERNEL + 1, 2**40])),
                 st.one_of(st.integers(0, 2), st.sampled_from([1000, 2**40])),
                 st.one_of(st.integers(1, 2), st.sampled_from([2**63 - 1])))
IMAGE_LAYERS = st.recursive(
    st.one_of(CONV, st.sampled_from(["relu", "batchnorm", "relu6", "hardswish"]),
              st.builds(lambda k: {"maxpool2d": k}, st.one_of(st.integers(1, 3), st.just(2**63 - 1)))),
    lambda inner: st.builds(lambda body: {"residual": body}, st.lists(inner, min_size=1, max_size=3)), max_leaves=6)
FLAT_LAYERS = st.one_of(st.builds(lambda w: {"linear": w}, WIDTHS), st.sampled_from(["relu", "batchnorm", "tanh"]),
                        st.builds(lambda p: {"dropout": p}, st.floats(0, 0.9)),
                        st.builds(lambda body: {"residual": body}, st.lists(st.builds(lambda w: {"linear": w}, WIDTHS),
                                                                             min_size=1, max_size=2)))
CHAINS = st.builds(lambda image, flat: [*image, "flatten", *flat, {"linear": 2}],
                   st.lists(IMAGE_LAYERS, max_size=4), st.lists(FLAT_LAYERS, max_size=3))
"""Layer lists that chain (image layers, flatten, linear layers, one output per class) but for what is too large
in them: they reach the bounds on widths, kernels, parameters and values per sample, and torch."""
LAYER_LISTS = st.one_of(
    CHAINS,
    st.lists(LAYERS, max_size=8),
    st.lists(LAYERS, max_size=3).map(lambda head: [*head, "flatten", {"linear": 2}]),
    st.integers(MAX_LAYERS - 2, MAX_LAYERS + 50).map(lambda n: ["relu"] * n + ["flatten", {"linear": 2}]),
    VALUES,
)
SHAPES = st.one_of(st.lists(INTS, max_size=6), st.sampled_from([[1, 8, 8], [3, 8, 8], [64], [3, 4096, 4096],
                                                                [1, 2**40, 2**40], [2**22 + 1]]), VALUES)
CLASSES = st.one_of(st.lists(st.text(min_size=1, max_size=8), min_size=0, max_size=6),
                    st.integers(2, 70_000).map(lambda n: [f"c{i}" for i in range(n)]), VALUES)
PATHS = st.one_of(st.sampled_from(["/etc/passwd", "../x", "a/../../b", "./../x", "a\0b", "~/x", "C:\\x", "..",
                                   ".", "ü/ß.npz", "a" * 1000, "%2e%2e/x", "a/./b//c"]), TEXT, VALUES)
SETTINGS = st.dictionaries(st.sampled_from(["lr", "batch_size", "sync_policy", "seed", "model_spec", "speed"]),
                           st.one_of(SCALARS, VALUES), max_size=3)
BROAD = st.fixed_dictionaries({"layers": st.one_of(CHAINS, LAYER_LISTS)}, optional={
    "job": st.fixed_dictionaries({"name": st.one_of(st.just("fuzz"), TEXT, VALUES)},
                                 optional={"target_accuracy": SCALARS, "max_minutes": SCALARS,
                                           "description": st.one_of(TEXT, VALUES)}),
    "input_shape": SHAPES, "classes": CLASSES,
    "entry_point": st.sampled_from(["no_such_module:build", "nocolon", ":", "os:abort", 3]),
    "mean": st.lists(SCALARS, max_size=4), "std": st.lists(SCALARS, max_size=4),
    "format": st.sampled_from(["npz", "csv", "image-folder", "digits", "tiff", 3]),
    "data_path": PATHS, "evaluation_path": PATHS, "local_share": SCALARS, "every": SCALARS,
    "training": SETTINGS, "ps": SETTINGS, "extra": st.dictionaries(TEXT, VALUES, max_size=2),
})
"""Many changes to ``BASE`` at once: most such files are refused while parsing."""
CHANGES = st.one_of(st.fixed_dictionaries({"layers": CHAINS}), st.fixed_dictionaries({"layers": CHAINS}),
                    st.fixed_dictionaries({"layers": LAYER_LISTS}), BROAD)
"""What a drawn job file changes of ``BASE``: its layers alone (three quarters: their model is checked, often built),
or many things at once."""


def job_file(changes: dict[str, Any]) -> str:
    """``BASE`` with ``changes``, as text (a value TOML cannot write makes the text itself garbage)."""
    tree = {section: dict(table) for section, table in BASE.items()}
    for key in ("layers", "input_shape", "classes", "entry_point"):
        if key in changes:
            tree["model"][key] = changes[key]
    if "entry_point" in changes:
        tree["model"].pop("layers")
    for key, section, field in (("mean", "data", "mean"), ("std", "data", "std"), ("format", "data", "format"),
                                ("data_path", "data", "path"), ("evaluation_path", "evaluation", "path"),
                                ("local_share", "evaluation", "local_share"), ("every", "evaluation", "every")):
        if key in changes:
            tree[section][field] = changes[key]
    tree["job"].update(changes.get("job", {}))
    for section in ("training", "ps", "extra"):
        if changes.get(section):
            tree[section] = changes[section]
    try:
        return render_job(tree)
    except (TypeError, RecursionError):
        return repr(tree)  # not TOML: refused as such


def nested(depth: int, opening: str, closing: str, inner: str) -> str:
    return opening * depth + inner + closing * depth


RAW = st.one_of(
    st.builds(lambda d: BASE_TEXT + "layers = [" + nested(d, "{residual = [", "]}", '"relu"') + ', "flatten", '
              "{linear = 2}]\n", st.integers(1, 600)),
    st.builds(lambda d: BASE_TEXT + "layers = [" + nested(d, "[", "]", '"relu"') + ', "flatten", {linear = 2}]\n',
              st.integers(1, 3000)),
    st.builds(lambda d: BASE_TEXT + "layers = [" + nested(d, "{a = ", "}", "1") + "]\n", st.integers(1, 3000)),
    st.builds(lambda n, w: BASE_TEXT + "layers = [" + ", ".join([f"{{conv2d = {w}, kernel = 1}}"] * n)
              + ', "flatten", {linear = 2}]\n', st.integers(1, 40), st.sampled_from([8, 4096, MAX_WIDTH])),
    st.text(max_size=300).map(lambda t: BASE_TEXT + t),
    st.binary(max_size=300),
    st.integers(MAX_JOB_FILE_BYTES - 10, MAX_JOB_FILE_BYTES + 10).map(lambda n: "#" * n),
)
"""Job files as raw text or bytes: nested past what a parser's recursion holds, huge, not TOML, not UTF-8."""
BASE_TEXT = ('[job]\nname = "fuzz"\n[data]\nformat = "npz"\npath = "d.npz"\n[evaluation]\nlocal_share = 0.2\n'
             '[model]\ninput_shape = [1, 8, 8]\nclasses = ["a", "b"]\n')


# --------------------------------------------------------------------------- the paths a job file takes


@pytest.fixture(scope="module")
def job_path() -> Iterator[Path]:
    """Where each drawn job file is written for ``prepare`` (which reads a file)."""
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder) / "job.toml"


def submit_and_host(text: str | bytes, job_path: Path) -> bool:
    """The job file through ``edgemesh job submit`` (``prepare``) and a host (``parse_job`` of the submission's
    bytes, ``host_model_spec``); whether it was accepted. Nothing but an EdgeMeshError may escape."""
    job_path.write_bytes(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    try:
        prepare(job_path)
    except EdgeMeshError:
        accepted = False
    else:
        accepted = True
    try:
        spec = parse_job(job_path.read_bytes(), origin="job fuzz")
        host_model_spec(spec, ModelsConfig())
    except EdgeMeshError:
        return False
    return accepted


@FUZZ
@given(changes=CHANGES)
@example(changes={"layers": ["flatten", {"linear": 10**8}, {"linear": 2}]})
@example(changes={"layers": [{"conv2d": 4, "kernel": 3, "stride": 2**63 - 1}, "flatten", {"linear": 2}]})
@example(changes={"input_shape": [3, 10_000, 10_000]})
@example(changes={"data_path": "/etc/passwd", "evaluation_path": "../shadow"})
def test_a_drawn_job_file_is_accepted_or_refused_with_an_edgemesh_error(changes: dict[str, Any],
                                                                        job_path: Path) -> None:
    submit_and_host(job_file(changes), job_path)


@settings(FUZZ, max_examples=RAW_EXAMPLES)
@given(text=RAW)
@example(text=BASE_TEXT + "layers = " + nested(5000, "[", "]", ""))
@example(text=BASE_TEXT + "layers = [" + nested(200, "{residual = [", "]}", '"relu"') + ', "flatten", {linear = 2}]')
def test_a_raw_job_file_is_accepted_or_refused_with_an_edgemesh_error(text: str | bytes, job_path: Path) -> None:
    submit_and_host(text, job_path)


def test_the_drawn_job_files_reach_every_check() -> None:
    """The fuzz is not all garbage: its base builds, and one change at a time reaches the model's checks."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "job.toml"
        assert submit_and_host(job_file({}), path)
        refusals = {}
        for name, changes in {"width": {"layers": ["flatten", {"linear": MAX_WIDTH + 1}]},
                              "layers": {"layers": ["relu"] * (MAX_LAYERS + 1) + ["flatten", {"linear": 2}]},
                              "path": {"data_path": "../x"}}.items():
            path.write_text(job_file(changes))
            with pytest.raises(JobError) as caught:
                prepare(path)
            refusals[name] = str(caught.value)
    assert f"may be at most {MAX_WIDTH}" in refusals["width"]
    assert f"more than {MAX_LAYERS}" in refusals["layers"]
    assert "data.path: '../x' must be a path relative to each host's data folder" in refusals["path"]


# --------------------------------------------------------------------------- the reproductions, through the command


@pytest.mark.parametrize(("layers", "says"), [
    (nested(300, "{residual = [", "]}", '"relu"'), "nest"),
    (nested(3000, "[", "]", '"relu"'), "nest too deeply"),
    (nested(60, "{residual = [", "]}", '"relu"'), "nest at most 3 deep"),
    ('"flatten", {linear = 100000000}, {linear = 2}', "linear output features may be at most 65536"),
    ('{conv2d = 128, kernel = 1}, {conv2d = 65536, kernel = 3}, "flatten", {linear = 2}',
     "more than the 50,000,000 a layer list may hold"),
    ('{conv2d = 4096, kernel = 3, padding = 1000}, "flatten", {linear = 2}', "values per sample"),
    (", ".join(['"relu"'] * 5000) + ', "flatten", {linear = 2}', "more than 1000"),
])
def test_job_submit_check_refuses_a_deep_or_huge_layer_list_without_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], layers: str, says: str) -> None:
    """Old: ``edgemesh job submit --check`` ended in a RecursionError (nested lists, residual blocks) or a torch
    RuntimeError (an allocation of 76.8 GB) traceback."""
    job = tmp_path / "job.toml"
    job.write_text(BASE_TEXT + f"layers = [{layers}]\n")
    assert cli.main(["job", "submit", str(job), "--check"]) == 2
    err = capsys.readouterr().err
    assert "is not a valid job" in err and says in err and "Traceback" not in err, err
