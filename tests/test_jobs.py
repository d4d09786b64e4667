"""The job file: parsing, every error named, the model it builds, the configuration a service runs it with."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from edgemesh.common import costs, models
from edgemesh.common.config import ModelsConfig, load_config
from edgemesh.common.errors import JobError
from edgemesh.common.jobs import check_model, job_config, parse_job, read_job_file, render_job, run_name
from edgemesh.local.demo import DIGITS_MODEL, DIGITS_NORMALIZATION
from edgemesh.operator.job import prepare

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

GOOD = """
[job]
name = "shapes"
target_accuracy = 0.9
max_minutes = 30

[model]
input_shape = [3, 16, 16]
classes = ["circle", "square", "triangle"]
layers = [{conv2d = 8, kernel = 3, padding = 1}, "relu", {maxpool2d = 2}, "flatten", {linear = 3}]

[data]
format = "image-folder"
path = "shapes"
mean = [0.5]
std = [0.25]

[evaluation]
path = "shapes-eval"

[training]
lr = 0.05
sync_policy = "adaptive"

[planner]
parallelism = "data"
"""


def problems(text: str) -> list[str]:
    with pytest.raises(JobError) as caught:
        spec = parse_job(text)
        check_model(spec)
    return caught.value.problems


def test_a_good_job_file_parses_and_builds() -> None:
    spec = parse_job(GOOD)
    assert (spec.name, spec.target_accuracy, spec.max_minutes) == ("shapes", 0.9, 30.0)
    assert spec.model.classes == ("circle", "square", "triangle") and spec.num_classes == 3
    assert spec.model_key.startswith("shapes@") and len(spec.sha256) == 64
    cost, layers, refusal = check_model(spec)
    assert cost.params == sum(p.numel() for p in models.build_model(spec.model_key).parameters())
    assert layers is not None and refusal == ""
    assert costs.cost(spec.model_key) == cost  # registered for the planner and the memory checks


def test_every_problem_of_a_job_file_is_named_at_once() -> None:
    bad = GOOD.replace('name = "shapes"', 'name = "sha pes"').replace("target_accuracy = 0.9", "target_accuracy = 2") \
        .replace('format = "image-folder"', 'format = "tiff"').replace("lr = 0.05", "lr = -1") \
        .replace('[evaluation]', '[evaluation]\nlocal_share = 0.2').replace("[planner]", "[planner]\nspeed = 3")
    found = problems(bad)
    for key in ("job.name", "job.target_accuracy", "data.format", "training.lr", "unknown setting(s) planner.speed"):
        assert any(p.startswith(key) for p in found), (key, found)
    assert len(found) >= 4


@pytest.mark.parametrize(("change", "named"), [
    (('"relu"', '"relux"'), "layer 2 ('relux'): unknown layer"),
    (("{linear = 3}", "{linear = 5}"), "layer 5"),
    (('"flatten", {linear = 3}', '{linear = 3}'), "layer 4"),
    (("{maxpool2d = 2}", "{maxpool2d = 64}"), "layer 3"),
])
def test_a_model_that_does_not_build_names_the_layer(change: tuple[str, str], named: str) -> None:
    found = problems(GOOD.replace(*change))
    assert any(named in p for p in found), found


def test_an_entry_point_that_does_not_import_is_named() -> None:
    text = GOOD.replace('layers = [{conv2d = 8, kernel = 3, padding = 1}, "relu", {maxpool2d = 2}, "flatten", '
                        '{linear = 3}]', 'entry_point = "no_such_models:build"')
    with pytest.raises(JobError) as caught:
        check_model(parse_job(text), trust=ModelsConfig(allowed=("no_such_models",)))
    assert any("no_such_models" in p and "does not import" in p for p in caught.value.problems), caught.value
    # a module the operator's configuration does not allow is refused, naming the setting
    found = problems(text)
    assert any("no_such_models" in p and "models.allowed" in p for p in found), found


def test_an_entry_point_model_from_the_job_files_directory(tmp_path: Path) -> None:
    (tmp_path / "my_models.py").write_text(
        "from torch import nn\n\ndef build(num_classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, num_classes))\n")
    job = tmp_path / "job.toml"
    job.write_text(GOOD.replace('layers = [{conv2d = 8, kernel = 3, padding = 1}, "relu", {maxpool2d = 2}, "flatten", '
                                '{linear = 3}]', 'entry_point = "my_models:build"'))
    spec, submission = prepare(job, trust=ModelsConfig(allowed=("my_models",)))
    assert submission.params == 3 * 16 * 16 * 3 + 3 and submission.sha256 == spec.sha256
    assert submission.layers and submission.refusal == ""


def test_mesh_parallelism_divides_depthwise_convolutions_and_residual_blocks_and_refuses_a_nested_one_by_name(
        tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    depthwise = '"relu", {conv2d = 16, kernel = 3, groups = 8, bias = false}, {maxpool2d = 2}'
    job.write_text(GOOD.replace('"relu", {maxpool2d = 2}', depthwise)
                   .replace('parallelism = "data"', 'parallelism = "mesh"'))
    _, submission = prepare(job)  # two filters a channel, without bias: divided in whole groups of 2
    conv2 = submission.layers[1]
    assert (conv2.name, conv2.units, conv2.group, conv2.bias, conv2.params_per_unit) == ("conv2", 16, 2, False, 9)
    residual = '"relu", {residual = [{conv2d = 8, kernel = 3, padding = 1}]}, {maxpool2d = 2}'
    job.write_text(GOOD.replace('"relu", {maxpool2d = 2}', residual)
                   .replace('parallelism = "data"', 'parallelism = "mesh"'))
    _, submission = prepare(job)  # a residual block: its body's layers divide by their paths
    assert "res1.body.conv1" in [layer.name for layer in submission.layers]
    nested = '"relu", {residual = [{residual = [{conv2d = 8, kernel = 3, padding = 1}]}]}, {maxpool2d = 2}'
    job.write_text(GOOD.replace('"relu", {maxpool2d = 2}', nested)
                   .replace('parallelism = "data"', 'parallelism = "mesh"'))
    with pytest.raises(JobError) as caught:  # a block inside a block: not divided
        prepare(job)
    assert "res1.body.res1" in str(caught.value) and "Residual" in str(caught.value)


def test_settings_the_job_sets_itself_are_refused() -> None:
    found = problems(GOOD.replace("lr = 0.05", 'lr = 0.05\nmodel_spec = "cifar-cnn"') + '\n[ps]\nstate_dir = "/x"\n')
    assert any(p.startswith("training.model_spec") for p in found)
    assert any(p.startswith("ps.state_dir") for p in found)


def test_a_broken_or_missing_file_is_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="cannot read"):
        read_job_file(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[job\nname = 1")
    with pytest.raises(JobError, match="not valid TOML"):
        read_job_file(broken)


def test_the_job_config_puts_the_jobs_settings_over_the_hosts(tmp_path: Path) -> None:
    host = load_config(env={}, overrides={"broker.url": "mqtt://10.0.0.5:1883", "ps.state_dir": str(tmp_path),
                                          "training.lr": "0.5", "worker.device": "pi-3"})
    spec = parse_job(GOOD)
    cfg = job_config(host, spec, run_name(spec, 1.5))
    assert cfg.job == "shapes" and cfg.broker.url == "mqtt://10.0.0.5:1883" and cfg.worker.device == "pi-3"
    assert (cfg.training.lr, cfg.training.sync_policy, cfg.training.model_spec) == (0.05, "adaptive", spec.model_key)
    assert cfg.training.dataset == "image-folder"
    assert cfg.ps.state_dir == str(tmp_path / "shapes" / f"1500-{spec.sha256[:12]}")


def test_the_examples_are_valid_jobs_and_the_demo_submits_the_digits_example() -> None:
    for path in sorted(EXAMPLES.glob("*.toml")):
        spec = read_job_file(path)
        if not spec.model.entry_point:
            check_model(spec)
    example = tomllib.loads((EXAMPLES / "digits.toml").read_text())
    assert example["model"] == DIGITS_MODEL
    assert {k: example["data"][k] for k in DIGITS_NORMALIZATION} == DIGITS_NORMALIZATION
    # the demo's layer list is the built-in digits CNN: same parameters, same cost
    spec = parse_job(render_job({"job": {"name": "d"}, "model": DIGITS_MODEL,
                                 "data": {"format": "digits", **DIGITS_NORMALIZATION}}))
    cost, _, _ = check_model(spec)
    assert cost == costs.cost("digits-cnn")


def test_the_readme_walk_through_submits_the_shapes_example() -> None:
    readme = (EXAMPLES.parent / "README.md").read_text()
    start = readme.index('   [job]\n   name = "shapes"')
    block = readme[start:readme.index("   ```", start)]
    shown = parse_job("\n".join(line[3:] for line in block.splitlines()))
    example = read_job_file(EXAMPLES / "shapes.toml")
    assert (shown.model, shown.data, shown.evaluation, dict(shown.settings), shown.max_minutes) == (
        example.model, example.data, example.evaluation, dict(example.settings), example.max_minutes)
