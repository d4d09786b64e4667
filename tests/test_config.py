"""Configuration loading: defaults < TOML file < ``EDGEMESH_*`` environment < flags (docs/operations.md).

Every test passes ``env=`` explicitly (or patches the environment) so the machine's own
``EDGEMESH_*`` variables cannot leak in.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from edgemesh.common.config import (
    AdaptiveConfig,
    BrokerConfig,
    Config,
    TrainingConfig,
    describe,
    load_config,
    to_toml,
)
from edgemesh.common.errors import ConfigError, EdgeMeshError


def _toml(tmp_path: Path, text: str, name: str = "edgemesh.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _error(**kwargs: object) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(**kwargs)  # type: ignore[arg-type]
    return str(exc.value)


# --------------------------------------------------------------------------- defaults


def test_defaults_are_valid_and_match_the_dataclasses() -> None:
    cfg = load_config(env={})
    assert cfg == Config()
    assert cfg.job == ""  # no job: the services serve submitted jobs
    assert (cfg.broker.host, cfg.broker.port, cfg.broker.tls) == ("127.0.0.1", 1883, False)
    assert cfg.broker.chunk_bytes < 1 << 20  # "well under 1 MiB" (docs/wire.md)
    assert cfg.training.sync_policy in ("sync", "async", "ssp", "adaptive")


def test_config_error_is_an_edgemesh_error() -> None:
    assert issubclass(ConfigError, EdgeMeshError)


def test_mqtts_url_defaults_to_port_8883() -> None:
    broker = BrokerConfig(url="mqtts://broker.example:8884")
    assert (broker.host, broker.port, broker.tls) == ("broker.example", 8884, True)
    assert BrokerConfig(url="mqtts://broker.example").port == 8883


# --------------------------------------------------------------------------- precedence


TOML = """
job = "from-file"

[training]
lr = 0.2
momentum = 0.5
batch_size = 16

[ps]
fsync = false
"""


def test_toml_file_overrides_defaults(tmp_path: Path) -> None:
    cfg = load_config(_toml(tmp_path, TOML), env={})
    assert cfg.job == "from-file"
    assert (cfg.training.lr, cfg.training.momentum, cfg.training.batch_size) == (0.2, 0.5, 16)
    assert cfg.ps.fsync is False
    assert cfg.training.weight_decay == TrainingConfig().weight_decay  # untouched fields keep defaults


def test_env_overrides_file_and_flags_override_env(tmp_path: Path) -> None:
    path = _toml(tmp_path, TOML)
    env = {"EDGEMESH_TRAINING__LR": "0.3", "EDGEMESH_TRAINING__MOMENTUM": "0.6", "EDGEMESH_JOB": "from-env"}
    cfg = load_config(path, env=env, overrides={"training.lr": "0.4"})
    assert cfg.training.lr == 0.4  # flag > env > file
    assert cfg.training.momentum == 0.6  # env > file
    assert cfg.training.batch_size == 16  # file > default
    assert cfg.job == "from-env"  # top-level env name
    assert load_config(path, env=env, overrides={"job": "from-flag"}).job == "from-flag"


def test_env_section_merges_with_the_file_section(tmp_path: Path) -> None:
    cfg = load_config(_toml(tmp_path, TOML), env={"EDGEMESH_PS__MAX_BATCH": "8"})
    assert cfg.ps.max_batch == 8 and cfg.ps.fsync is False


def test_env_names_are_case_insensitive_after_the_prefix() -> None:
    assert load_config(env={"EDGEMESH_Training__Batch_Size": "12"}).training.batch_size == 12


def test_edgemesh_config_picks_the_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'job = "picked"\n')
    assert load_config(env={"EDGEMESH_CONFIG": str(path)}).job == "picked"


def test_an_explicit_path_beats_edgemesh_config(tmp_path: Path) -> None:
    picked = _toml(tmp_path, 'job = "explicit"\n', "a.toml")
    other = _toml(tmp_path, 'job = "from-env-var"\n', "b.toml")
    assert load_config(picked, env={"EDGEMESH_CONFIG": str(other)}).job == "explicit"


def test_the_process_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEMESH_JOB", "from-os-env")
    monkeypatch.setenv("EDGEMESH_BROKER__URL", "mqtt://10.0.0.2:1884")
    cfg = load_config()
    assert cfg.job == "from-os-env" and (cfg.broker.host, cfg.broker.port) == ("10.0.0.2", 1884)


def test_other_environment_variables_are_ignored() -> None:
    cfg = load_config(env={"HOME": "/root", "EDGEMESHX_JOB": "nope", "MQTT_URL": "nope"})
    assert cfg == Config()


def test_flags_accept_typed_values() -> None:
    cfg = load_config(env={}, overrides={"training.lr": 0.05, "ps.fsync": False, "demo.workers": 8,
                                         "compressor.overrides": {"pi-07": "none"}})
    assert (cfg.training.lr, cfg.ps.fsync, cfg.demo.workers) == (0.05, False, 8)
    assert cfg.compressor.overrides == {"pi-07": "none"}


# --------------------------------------------------------------------------- coercion


@pytest.mark.parametrize("text,value", [("1", True), ("true", True), ("TRUE", True), ("yes", True), ("on", True),
                                        ("0", False), ("false", False), ("No", False), ("off", False)])
def test_bool_from_string(text: str, value: bool) -> None:
    assert load_config(env={"EDGEMESH_PS__FSYNC": text}).ps.fsync is value


def test_int_float_literal_and_dict_from_strings() -> None:
    cfg = load_config(env={
        "EDGEMESH_TRAINING__BATCH_SIZE": "32",
        "EDGEMESH_TRAINING__LR": "2e-2",
        "EDGEMESH_TRAINING__SYNC_POLICY": "adaptive",
        "EDGEMESH_BROKER__PROTOCOL": "3.1.1",
        "EDGEMESH_BROKER__CONNECT_TIMEOUT_S": "3",
        "EDGEMESH_COMPRESSOR__OVERRIDES": '{"pi-07": "none", "pi-08": "grid"}',
    })
    assert cfg.training.batch_size == 32 and isinstance(cfg.training.batch_size, int)
    assert cfg.training.lr == 0.02
    assert cfg.training.sync_policy == "adaptive"
    assert cfg.broker.protocol == "3.1.1"
    assert cfg.broker.connect_timeout_s == 3.0 and isinstance(cfg.broker.connect_timeout_s, float)
    assert cfg.compressor.overrides == {"pi-07": "none", "pi-08": "grid"}


def test_toml_tables_and_ints_for_floats(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[compressor.overrides]\n"pi-07" = "none"\n[training]\nlr = 1\n')
    cfg = load_config(path, env={})
    assert cfg.compressor.overrides == {"pi-07": "none"}
    assert cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)


# --------------------------------------------------------------------------- errors name the key


def test_unknown_key_in_toml_names_it(tmp_path: Path) -> None:
    message = _error(path=_toml(tmp_path, "[training]\nlearning_rate = 0.1\n"), env={})
    assert "training.learning_rate" in message


def test_unknown_section_in_toml_names_it(tmp_path: Path) -> None:
    assert "trainer" in _error(path=_toml(tmp_path, "[trainer]\nlr = 0.1\n"), env={})


def test_unknown_top_level_key_in_toml_names_it(tmp_path: Path) -> None:
    assert "jobname" in _error(path=_toml(tmp_path, 'jobname = "x"\n'), env={})


def test_unknown_env_section_names_the_variable() -> None:
    assert "EDGEMESH_TRAINER__LR" in _error(env={"EDGEMESH_TRAINER__LR": "0.1"})


def test_unknown_env_field_names_the_key() -> None:
    assert "training.learning_rate" in _error(env={"EDGEMESH_TRAINING__LEARNING_RATE": "0.1"})


def test_unknown_flag_names_the_key() -> None:
    assert "ps.lr" in _error(env={}, overrides={"ps.lr": 0.1})


@pytest.mark.parametrize("env,key", [
    ({"EDGEMESH_TRAINING__BATCH_SIZE": "many"}, "training.batch_size"),
    ({"EDGEMESH_TRAINING__BATCH_SIZE": "1.5"}, "training.batch_size"),
    ({"EDGEMESH_TRAINING__LR": "fast"}, "training.lr"),
    ({"EDGEMESH_PS__FSYNC": "maybe"}, "ps.fsync"),
    ({"EDGEMESH_TRAINING__SYNC_POLICY": "bsp"}, "training.sync_policy"),
    ({"EDGEMESH_BROKER__PROTOCOL": "4"}, "broker.protocol"),
    ({"EDGEMESH_COMPRESSOR__OVERRIDES": "pi-07=none"}, "compressor.overrides"),
    ({"EDGEMESH_COMPRESSOR__OVERRIDES": '["pi-07"]'}, "compressor.overrides"),
    ({"EDGEMESH_COMPRESSOR__OVERRIDES": '{"pi-07": "zip"}'}, "compressor.overrides"),
    ({"EDGEMESH_COMPRESSOR__OVERRIDES": '{"pi/07": "none"}'}, "compressor.overrides"),
    ({"EDGEMESH_TRAINING": "x"}, "training"),
], ids=["int-word", "int-float", "float-word", "bool-word", "literal", "literal-int", "dict-not-json",
        "dict-array", "dict-bad-codec", "dict-bad-device", "section-scalar"])
def test_bad_types_from_env_name_the_key(env: dict[str, str], key: str) -> None:
    assert key in _error(env=env)


@pytest.mark.parametrize("text,key", [
    ('[training]\nlr = "fast"\n', "training.lr"),
    ("[training]\nbatch_size = 1.5\n", "training.batch_size"),
    ("[training]\nbatch_size = true\n", "training.batch_size"),
    ("[ps]\nfsync = 1\n", "ps.fsync"),
    ("[broker]\nprotocol = 5\n", "broker.protocol"),
    ("[broker]\nurl = 1883\n", "broker.url"),
    ('training = "fast"\n', "training"),
    ("[compressor]\noverrides = 3\n", "compressor.overrides"),
], ids=["str-float", "float-int", "bool-int", "int-bool", "int-literal", "int-str", "scalar-section", "int-dict"])
def test_bad_types_in_toml_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    assert key in _error(path=_toml(tmp_path, text), env={})


@pytest.mark.parametrize("key,value", [
    ("training.lr", "0"),
    ("training.lr", "-0.1"),
    ("training.lr", "nan"),
    ("training.lr", "inf"),
    ("training.weight_decay", "inf"),
    ("training.momentum", "1"),
    ("training.batch_size", "0"),
    ("training.staleness_bound", "-1"),
    ("training.partition_alpha", "0"),
    ("broker.url", "http://x"),
    ("broker.url", "mqtt://"),
    ("broker.keepalive_s", "0"),
    ("broker.chunk_bytes", "100"),
    ("broker.backoff_initial_s", "20"),
    ("broker.connect_timeout_s", "inf"),
    ("metrics.address", "localhost"),
    ("metrics.address", "0.0.0.0:70000"),
    ("ps.checkpoint_every", "0"),
    ("planner.min_devices", "0"),
    ("planner.grid_slack", "-0.1"),
    ("planner.grid_slack", "2"),
    ("worker.device", "pi/1"),
    ("worker.threads", "0"),
    ("demo.workers", "65"),
    ("demo.target_accuracy", "1.5"),
    ("job", "a/b"),
    ("job", "+"),
    ("log_level", "LOUD"),
])
def test_out_of_range_values_name_the_key(key: str, value: str) -> None:
    message = _error(env={}, overrides={key: value})
    assert message.startswith(key) or key in message


def test_invalid_toml_syntax_names_the_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[training\nlr = 0.1\n")
    message = _error(path=path, env={})
    assert str(path) in message


def test_a_toml_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('job = "caf\u00e9"\n'.encode("latin-1"))
    assert str(path) in _error(path=path, env={})


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    message = _error(path=path, env={})
    assert str(path) in message and "not found" in message
    assert str(path) in _error(env={"EDGEMESH_CONFIG": str(path)})


def test_a_directory_as_config_file_is_a_config_error(tmp_path: Path) -> None:
    assert str(tmp_path) in _error(path=tmp_path, env={})


# --------------------------------------------------------------------------- describe


def test_describe_lists_every_leaf_and_masks_the_password() -> None:
    cfg = load_config(env={"EDGEMESH_BROKER__USERNAME": "worker", "EDGEMESH_BROKER__PASSWORD": "hunter2"})
    rows = {key: value for key, value, _doc in describe(cfg)}
    assert rows["broker.password"] == "***"
    assert rows["broker.username"] == "worker"
    assert "hunter2" not in repr(describe(cfg))
    assert rows["job"] == "" and rows["training.lr"] == cfg.training.lr
    def leaves(section: object) -> int:
        return sum(leaves(v) if dataclasses.is_dataclass(v := getattr(section, f.name)) else 1
                   for f in dataclasses.fields(section))  # type: ignore[arg-type]

    assert len(rows) == leaves(cfg)
    assert rows["ps.adaptive.alpha"] == 0.3  # a nested section's keys are dotted twice


def test_describe_shows_an_empty_password_as_empty() -> None:
    rows = {key: value for key, value, _doc in describe(Config())}
    assert rows["broker.password"] == ""


def test_to_toml_round_trips_a_changed_config(tmp_path: Path) -> None:
    cfg = load_config(env={}, overrides={"job": "lab-1", "training.lr": "0.25", "ps.fsync": "false",
                                         "ps.adaptive.alpha": "0.5", "ps.adaptive.window": "4",
                                         "compressor.overrides": '{"pi-7": "none", "pi-8": "fp16"}',
                                         "broker.password": 'p"w\\\\x', "models.allowed": "acme,lab.nets",
                                         "models.path": '["/opt/edgemesh/models"]'})
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path, env={}) == cfg
    assert "[ps.adaptive]" in to_toml(cfg)


# --------------------------------------------------------------------------- nested sections


def test_the_adaptive_rule_is_a_nested_section_from_toml_env_and_flags(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[ps]\ncheckpoint_every = 7\n[ps.adaptive]\nalpha = 0.5\nmin_bound = 2\n")
    cfg = load_config(path, env={"EDGEMESH_PS__ADAPTIVE__SLACK": "2.5"}, overrides={"ps.adaptive.quantile": "0.8"})
    assert cfg.ps.checkpoint_every == 7
    assert cfg.ps.adaptive == AdaptiveConfig(alpha=0.5, min_bound=2, slack=2.5, quantile=0.8)
    # the flag beats the environment, which beats the file
    cfg = load_config(path, env={"EDGEMESH_PS__ADAPTIVE__ALPHA": "0.7"}, overrides={"ps.adaptive.alpha": "0.9"})
    assert cfg.ps.adaptive.alpha == 0.9
    assert load_config(path, env={"EDGEMESH_PS__ADAPTIVE__ALPHA": "0.7"}).ps.adaptive.alpha == 0.7


@pytest.mark.parametrize("key,value", [("ps.adaptive.alpha", "0"), ("ps.adaptive.slack", "0.5"),
                                       ("ps.adaptive.max_deadline_s", "0.001"), ("ps.adaptive.window", "0")])
def test_the_adaptive_rule_s_settings_are_validated_with_their_key(key: str, value: str) -> None:
    assert key in _error(env={}, overrides={key: value})


def test_the_old_flat_adaptive_keys_are_unknown() -> None:
    assert "ps.adaptive_alpha" in _error(env={}, overrides={"ps.adaptive_alpha": "0.5"})
    assert "ps.adaptive.nope" in _error(env={"EDGEMESH_PS__ADAPTIVE__NOPE": "1"})


def test_codec_names_are_checked_where_they_are_set() -> None:
    assert "compressor.overrides.pi-1" in _error(env={}, overrides={"compressor.overrides": '{"pi-1": "gzip"}'})
    assert "compressor.adaptive_codec" in _error(env={}, overrides={"compressor.adaptive_codec": "fp16"})
    assert "ps.delta_codec" in _error(env={}, overrides={"ps.delta_codec": "zip"})
