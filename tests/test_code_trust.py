"""Only code the host installed runs: a job's entry point is imported only from a module the building machine's own
``[models]`` configuration allows, a job's ``model.module_path`` adds no directory to a host's import path, and
``edgemesh predict`` and ``edgemesh job export`` import no code a model card or a job names without ``--trust-code``.

The modules these tests write leave a marker file when they are imported: a refusal is checked by the marker's
absence (nothing ran), an import by its presence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import inbox, make_config, until

from edgemesh import cli
from edgemesh.bench.job_fleet import host_models
from edgemesh.common.config import ModelsConfig, load_config, to_toml
from edgemesh.common.errors import ConfigError, ExportError, JobError, ModelError
from edgemesh.common.jobs import host_model_spec, parse_job, render_job
from edgemesh.common.messages import JobState, JobSubmission, ModelSnapshot
from edgemesh.common.models import entry_point_spec
from edgemesh.common.models.entry_point import ANY_MODULE, module_allowed
from edgemesh.common.topics import Topics, all_job_states_filter
from edgemesh.common.wire.tensors import Tensor
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.demo import DIGITS_MODEL, DIGITS_NORMALIZATION
from edgemesh.local.processes import LocalCluster, scrape
from edgemesh.operator.export import ModelCard, export_model, write_card
from edgemesh.operator.job import export, prepare, submission_of
from edgemesh.services.host import JobHost
from edgemesh.services.parameter_server import jobs as ps_jobs
from edgemesh.services.parameter_server.jobs import JobBoard
from edgemesh.services.worker import command as worker_command

PS_START_S = 90.0
"""How long a parameter server process may take to start and fail a job on a loaded host (torch imports first)."""
FEATURES = 16
CLASSES = ("idle", "normal", "worn")


def sensor_job(name: str, model: str) -> str:
    """A job on each device's CSV of ``FEATURES`` features whose ``[model]`` ends with the TOML lines ``model``."""
    return f"""
[job]
name = "{name}"
max_versions = 100000

[model]
input_shape = [{FEATURES}]
classes = {json.dumps(list(CLASSES))}
{model}

[data]
format = "csv"
path = "sensors.csv"
label_column = "state"

[evaluation]
local_share = 0.2
"""


def digits_entry_job(name: str, model: str) -> str:
    """A job on digits (no data to read on any host) whose model is the entry point of the TOML lines ``model``."""
    return f"""
[job]
name = "{name}"
max_versions = 100000

[model]
input_shape = [1, 8, 8]
classes = {json.dumps([str(d) for d in range(10)])}
{model}

[data]
format = "digits"
"""


def marker_module(directory: Path, marker: Path, *, body: str = "") -> str:
    """A module in ``directory`` that writes ``marker`` when imported and whose ``build`` returns a linear model
    (of ``FEATURES`` inputs, or of a digits image); its (unique) name."""
    name = f"em_trust_{uuid.uuid4().hex[:8]}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.py").write_text(
        "from pathlib import Path\nfrom torch import nn\n\n"
        f"Path({str(marker)!r}).write_text('imported')\n\n"
        "def build(input_shape, num_classes):\n"
        "    features = 1\n"
        "    for d in input_shape:\n"
        "        features *= d\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(features, num_classes))\n" + body)
    return name


@pytest.fixture
def forget_modules() -> Iterator[list[str]]:
    """Names of modules a test imported on purpose, dropped from ``sys.modules`` afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        sys.modules.pop(name, None)


def raw_submission(text: str, *, params: int = 0) -> JobSubmission:
    """The submission of job file ``text`` as ``edgemesh job submit`` publishes it, with no check of its model: cost
    figures made up (``params``, or none: a host then refuses the job for the missing figures, not for its code)."""
    source = text.encode()
    return JobSubmission(name=parse_job(text).name, source=source, sha256=hashlib.sha256(source).hexdigest(),
                         submitted_at=time.time(), params=params, macs_per_sample=params,
                         activations_per_sample=FEATURES)


def digits_job(name: str) -> JobSubmission:
    """A layer-list job on digits, checked and costed as ``edgemesh job submit`` does."""
    spec = parse_job(render_job({"job": {"name": name, "max_versions": 100000}, "model": DIGITS_MODEL,
                                 "data": {"format": "digits", **DIGITS_NORMALIZATION}}))
    return dataclasses.replace(submission_of(spec, search_path=[]), submitted_at=time.time())


# --------------------------------------------------------------------------- the allow-list


def test_an_allowed_prefix_matches_whole_dotted_components() -> None:
    assert module_allowed("acme.cnn", ["acme.cnn"]) and module_allowed("acme.cnn.v2", ["acme.cnn"])
    assert not module_allowed("acme.cnnx", ["acme.cnn"]) and not module_allowed("acme", ["acme.cnn"])
    assert module_allowed("acme.cnn", ["lab", "acme"]) and not module_allowed("acmex", ["acme"])
    assert not module_allowed("os", []) and module_allowed("os", ANY_MODULE)
    with pytest.raises(TypeError):
        module_allowed("a", "abc")  # a bare string is not a list of prefixes


def test_the_models_section_comes_from_the_hosts_file_environment_and_flags_never_from_a_job(tmp_path: Path) -> None:
    file = tmp_path / "host.toml"
    file.write_text('[models]\nallowed = ["acme_models"]\npath = ["/opt/edgemesh/models"]\n')
    assert load_config(file, env={}).models == ModelsConfig(allowed=("acme_models",), path=("/opt/edgemesh/models",))
    by_env = load_config(file, env={"EDGEMESH_MODELS__ALLOWED": "acme_models.cnn, lab.nets"})
    assert by_env.models.allowed == ("acme_models.cnn", "lab.nets")
    by_flag = load_config(file, env={}, overrides={"models.path": '["/srv/a", "/srv/b"]', "models.allowed": ""})
    assert by_flag.models == ModelsConfig(allowed=(), path=("/srv/a", "/srv/b"))
    (tmp_path / "written.toml").write_text(to_toml(by_flag))  # as LocalCluster writes a fleet's file
    assert load_config(tmp_path / "written.toml", env={}).models == by_flag.models
    for key, value, says in (("models.allowed", "os:abort", "not a module name"),
                             ("models.allowed", '["acme", ""]', "not a module name"),
                             ("models.path", "models", "not an absolute directory")):
        with pytest.raises(ConfigError, match=f"{key}.*{says}"):
            load_config(env={}, overrides={key: value})
    # the default allows nothing: a job brings a layer list, or code its hosts were told to trust
    assert load_config(env={}).models == ModelsConfig()
    with pytest.raises(JobError, match=r"\[models\]: unknown section"):
        parse_job(sensor_job("sneaky", 'entry_point = "os:abort"') + '\n[models]\nallowed = ["os"]\n')


def test_a_module_the_allow_list_leaves_out_is_refused_before_it_is_imported(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    name = marker_module(tmp_path / "mods", marker)
    for allowed in ((), ("other",), (f"{name}.sub",), (name[:-1],)):
        with pytest.raises(ModelError, match=f"module '{name}' is not allowed here.*models.allowed"):
            entry_point_spec("t-refused", f"{name}:build", (FEATURES,), 3, allowed=allowed,
                             search_path=[tmp_path / "mods"])
    assert not marker.exists() and name not in sys.modules


def test_an_allowed_module_leads_to_no_code_it_does_not_define(tmp_path: Path, forget_modules: list[str]) -> None:
    """Its imports are not entry points: ``gate:spy.touch``, a re-exported ``touch`` or a private name are refused
    (``acme_models:os.abort`` would otherwise abort a host whose allowed module imports ``os``)."""
    touched = tmp_path / "touched"
    spy = f"em_spy_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{spy}.py").write_text(f"from pathlib import Path\n\ndef touch():\n"
                                        f"    Path({str(touched)!r}).write_text('called')\n")
    gate = marker_module(tmp_path, tmp_path / "gate-imported",
                         body=f"\nimport {spy}\nfrom {spy} import touch\n\ndef _hidden(num_classes):\n"
                              "    return build((16,), num_classes)\n")
    forget_modules.extend([gate, spy])
    for attribute, says in ((f"{spy}.touch", f"is the module '{spy}', which is not allowed"),
                            ("touch", f"is defined in module '{spy}', which is not allowed"),
                            ("_hidden", "'_hidden' is a private name"),
                            ("nn.Linear", "is the module 'torch.nn', which is not allowed")):
        with pytest.raises(ModelError, match=says):
            entry_point_spec("t-gate", f"{gate}:{attribute}", (FEATURES,), 3, allowed=[gate], search_path=[tmp_path])
    assert not touched.exists()
    assert entry_point_spec("t-gate", f"{gate}:build", (FEATURES,), 3, allowed=[gate],
                            search_path=[tmp_path]).builder()(torch.zeros(2, FEATURES)).shape == (2, 3)


# --------------------------------------------------------------------------- at submission


def test_an_entry_point_outside_the_operators_allow_list_is_refused_at_submit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], forget_modules: list[str]) -> None:
    job = tmp_path / "abort.toml"
    job.write_text(sensor_job("abort", 'entry_point = "os:abort"'))
    assert cli.main(["job", "submit", str(job), "--check"]) == 2
    err = capsys.readouterr().err
    assert "entry point 'os:abort'" in err and "module 'os' is not allowed" in err and "models.allowed" in err
    # a module beside the job file: refused too, unless the operator's configuration allows it
    marker = tmp_path / "imported"
    name = marker_module(tmp_path, marker)
    forget_modules.append(name)
    mine = tmp_path / "mine.toml"
    mine.write_text(sensor_job("mine", f'entry_point = "{name}:build"'))
    with pytest.raises(JobError, match=f"module '{name}' is not allowed"):
        prepare(mine)
    assert not marker.exists()
    assert cli.main(["job", "submit", str(mine), "--check", "--set", f"models.allowed={name}"]) == 0
    assert marker.exists() and "job mine is valid" in capsys.readouterr().out


# --------------------------------------------------------------------------- on the hosts


@pytest.mark.timeout(300)  # a parameter server process starts (torch) on a host shared with other tests
async def test_os_abort_submitted_raw_fails_the_job_on_the_ps_host_which_serves_the_next_job(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """Bypassing the operator's check, ``entry_point = "os:abort"`` reaches a running PS host: the job fails there once,
    saying why; the process keeps running (it used to end with code 134, on every restart) and serves the next job."""
    config = make_config(mosquitto_broker, job="trust", **{"broker.backoff_max_s": "0.5"})
    cluster = LocalCluster(config, tmp_path, serve_jobs=True)
    ps = cluster.spawn("ps", "ps", ["--state-dir", str(tmp_path / "state")])
    try:
        nxt = digits_job("next")
        async with inbox(config, (all_job_states_filter(), JobState),
                         (Topics("next").model_filter(), ModelSnapshot)) as box:
            await box.publish(Topics("abort").job_file(), raw_submission(sensor_job("abort", 'entry_point = '
                                                                                    '"os:abort"'), params=51),
                              retain=True)
            failed = await box.next(JobState, lambda s: s.name == "abort" and s.ended, PS_START_S)
            assert failed.state == "failed", failed
            assert "cannot serve this job" in failed.reason and "entry point 'os:abort'" in failed.reason
            assert "module 'os' is not allowed" in failed.reason and "models.allowed" in failed.reason
            await box.publish(Topics("next").job_file(), nxt, retain=True)
            await box.next(JobState, lambda s: s.name == "next" and s.state == "running", PS_START_S)
            first = await box.next(ModelSnapshot, lambda m: m.model_spec == parse_job(nxt.source).model_key,
                                   PS_START_S)
            assert first.version == 0  # the PS of the next job serves its model
            assert [s.state for s in box.of(JobState) if s.name == "abort" and s.ended] == ["failed"]
        assert ps.proc.poll() is None, ps.log_path.read_text()[-2000:]
        samples = await asyncio.to_thread(scrape, ps.port_file)
        jobs = {dict(labels)["outcome"]: v for (n, labels), v in samples.items() if n == "edgemesh_ps_host_jobs_total"}
        assert jobs["refused"] == 1 and jobs["served"] == 1 and jobs["failed"] == 0
    finally:
        cluster.stop()


async def test_a_jobs_module_path_adds_no_directory_on_the_hosts(mosquitto_broker: BrokerProcess, tmp_path: Path,
                                                                  forget_modules: list[str]) -> None:
    """A job naming a module the hosts allow, in a directory of its own choosing (``model.module_path``): neither the
    PS host nor a worker imports anything from it; both refuse, naming module_path, and the job fails saying why. A
    host whose own ``models.path`` lists the directory builds it."""
    marker = tmp_path / "imported"
    directory = tmp_path / "dropped"
    name = marker_module(directory, marker)
    forget_modules.append(name)
    trusting = {"models.allowed": name, "models.path": json.dumps([str(tmp_path / "host-models")])}
    config = make_config(mosquitto_broker, job="", **{"ps.state_dir": tmp_path / "state"}, **trusting)
    model = f'entry_point = "{name}:build"\nmodule_path = "{directory}"'

    # a worker, told the job runs (as the PS's board would say): it refuses, and imports nothing
    worker = JobHost("worker", make_config(mosquitto_broker, job="", **trusting), worker_command.for_job, device="w1")
    dropped = raw_submission(digits_entry_job("dropped", model), params=650)
    async with inbox(make_config(mosquitto_broker, job="dropped")) as box:
        await box.publish(Topics("dropped").job_file(), dropped, retain=True)
        await box.publish(Topics("dropped").job_state(), JobState(
            name="dropped", state="running", sha256=dropped.sha256, submitted_at=dropped.submitted_at,
            started_at=time.time()), retain=True)
        task = asyncio.create_task(worker.run())
        try:
            refusal = await until("the worker's refusal", lambda: worker.refusal)
        finally:
            worker.stop.set()
            await asyncio.wait_for(task, 30)
    assert f"model.module_path '{directory}' is not one of this host's models.path" in str(refusal)

    # the PS host, with its job board: the job fails with the reason
    host = JobHost("ps", config, ps_jobs.for_job)
    task = asyncio.create_task(host.run(extra=JobBoard(host).attach))
    try:
        async with inbox(make_config(mosquitto_broker, job="module-path"), (all_job_states_filter(), JobState)) as box:
            await box.publish(Topics("module-path").job_file(),
                              raw_submission(digits_entry_job("module-path", model), params=650), retain=True)
            failed = await box.next(JobState, lambda s: s.name == "module-path" and s.ended, 60)
    finally:
        host.stop.set()
        await asyncio.wait_for(task, 30)
    assert failed.state == "failed" and "model.module_path" in failed.reason and str(directory) in failed.reason
    assert not marker.exists() and name not in sys.modules

    # the marker works: a host that lists the directory in its own models.path imports the module
    host_model_spec(parse_job(digits_entry_job("listed", model)), ModelsConfig(allowed=(name,), path=(str(directory),)))
    assert marker.exists()


# --------------------------------------------------------------------------- predict and export


def write_bundle(directory: Path, marker: Path, fmt: str = "torch") -> tuple[Path, str]:
    """A model exported with its card whose job names an entry point that sits beside the model file and writes
    ``marker`` when imported; the model file and the module's name."""
    name = marker_module(directory, marker)
    text = sensor_job("bundled", f'entry_point = "{name}:build"')
    spec = parse_job(text)
    module = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(FEATURES, len(CLASSES)))
    path = export_model(module, (FEATURES,), fmt, directory / f"bundled.{fmt}")
    write_card(ModelCard(job=spec.name, classes=CLASSES, input_shape=(FEATURES,), mean=(), std=(), accuracy=None,
                         version=1, job_sha256=spec.sha256, format=fmt, file=path.name, model_key=spec.model_key,
                         exported_at=time.time(), job_source=text), path)
    return path, name


def test_predict_imports_no_code_beside_a_model_without_trust_code(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                    forget_modules: list[str]) -> None:
    marker = tmp_path / "imported"
    model, name = write_bundle(tmp_path / "bundle", marker)
    forget_modules.append(name)
    sample = tmp_path / "x.npy"
    np.save(sample, np.random.default_rng(0).random(FEATURES, dtype=np.float32))
    assert cli.main(["predict", str(model), str(sample)]) == 2
    err = capsys.readouterr().err
    assert f"entry point '{name}:build'" in err and "--trust-code" in err
    assert not marker.exists() and name not in sys.modules
    assert cli.main(["predict", str(model), str(sample), "--trust-code"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"{sample}  ") and any(c in printed for c in CLASSES)
    assert marker.exists()  # the user trusted the bundle's code: it ran


def test_predict_with_trust_code_imports_from_the_module_path_given(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                     forget_modules: list[str]) -> None:
    """A bundle whose code is not beside it: ``--trust-code --module-path DIR`` finds it where the user says."""
    marker = tmp_path / "imported"
    model, name = write_bundle(tmp_path / "bundle", marker, fmt="safetensors")
    forget_modules.append(name)
    (tmp_path / "code").mkdir()
    (tmp_path / "bundle" / f"{name}.py").rename(tmp_path / "code" / f"{name}.py")
    sample = tmp_path / "x.npy"
    np.save(sample, np.zeros(FEATURES, dtype=np.float32))
    assert cli.main(["predict", str(model), str(sample), "--trust-code"]) == 2
    assert "does not import" in capsys.readouterr().err and not marker.exists()
    assert cli.main(["predict", str(model), str(sample), "--trust-code", "--module-path", str(tmp_path / "code")]) == 0
    assert marker.exists()


async def test_job_export_imports_no_code_a_job_names_without_trust_code(
        mosquitto_broker: BrokerProcess, tmp_path: Path, forget_modules: list[str]) -> None:
    """``edgemesh job export`` of a job (on the broker: its file and its final model) whose entry point sits in its
    ``model.module_path``: refused, naming --trust-code, with nothing imported; with --trust-code it writes the
    model."""
    marker = tmp_path / "imported"
    directory = tmp_path / "job-code"
    name = marker_module(directory, marker)
    forget_modules.append(name)
    job = raw_submission(sensor_job("exported", f'entry_point = "{name}:build"\nmodule_path = "{directory}"'))
    spec = parse_job(job.source)
    weights = {"1.weight": np.ones((len(CLASSES), FEATURES), np.float32), "1.bias": np.zeros(len(CLASSES), np.float32)}
    config = make_config(mosquitto_broker, job="exported")
    async with inbox(config) as box:
        await box.publish(Topics("exported").job_file(), job, retain=True)
        await box.publish(Topics("exported").job_model(), ModelSnapshot(
            version=7, model_spec=spec.model_key, tensors={k: Tensor.from_numpy(v) for k, v in weights.items()}),
            retain=True)
    out = tmp_path / "out" / "exported.pt"
    with pytest.raises(ExportError, match=f"entry point '{name}:build'.*--trust-code"):
        await export(config, "exported", fmt="torch", out=str(out), search_path=[], timeout_s=10)
    with pytest.raises(ExportError, match="--trust-code.*any format, ONNX included, builds the model"):
        await export(config, "exported", fmt="onnx", out=str(out), search_path=[], timeout_s=10)
    assert not marker.exists() and not out.exists()
    assert await export(config, "exported", fmt="torch", out=str(out), search_path=[], timeout_s=10,
                        trust_code=True) == 0
    assert marker.exists() and ModelCard.read(out.with_name(out.name + ".card.json")).version == 7


def test_the_benchmarks_hosts_allow_the_modules_the_benchmark_wrote(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "glyph_net.py").write_text("")
    flags = host_models(tmp_path)
    settings = dict(flag.split("=", 1) for flag in flags[1::2])
    assert load_config(env={}, overrides=settings).models == ModelsConfig(allowed=("glyph_net",),
                                                                          path=(str(tmp_path / "models"),))
