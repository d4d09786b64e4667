"""Exporting a trained model (ONNX, safetensors, torch) with its model card, and ``edgemesh predict`` on the
files: ONNX logits equal torch's for any batch size, state-dict files load back into a fresh model, the
card reads back, errors name what is wrong, and predicting with an ONNX file never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import safetensors.torch
import torch
from PIL import Image

from edgemesh import cli
from edgemesh.common import models
from edgemesh.common.data import load_dataset, read_image
from edgemesh.common.errors import ExportError
from edgemesh.common.jobs import model_spec, parse_job
from edgemesh.operator.export import (
    CARD_SUFFIX,
    ModelCard,
    card_path,
    check_onnx,
    export_model,
    normalization,
    write_card,
)
from edgemesh.operator.predict import PREDICT_BATCH

TOLERANCE = 1e-4
DIGITS_SHAPE = (1, 8, 8)
DIGITS_CLASSES = tuple(str(d) for d in range(10))
FEATURES_SPEC = "test-export-features"
FEATURES_SHAPE = (6,)
TRAIN_STEPS = 60
SUBPROCESS_TIMEOUT_S = 90.0
TINY_JOB = """\
[job]
name = "tiny"
[model]
input_shape = [1, 8, 8]
classes = ["0","1","2","3","4","5","6","7","8","9"]
layers = [{conv2d = 4, kernel = 3, padding = 1}, "relu", {maxpool2d = 2}, "flatten", {linear = 10}]
[data]
format = "digits"
"""
PREDICT_WITHOUT_TORCH = """\
import sys
from edgemesh.cli import main
code = main(sys.argv[1:])
assert "torch" not in sys.modules, "edgemesh predict imported torch for an ONNX model"
sys.exit(code)
"""


def train(model: torch.nn.Module, steps: int = TRAIN_STEPS, seed: int = 0) -> torch.nn.Module:
    """``model`` after ``steps`` SGD steps on digits (through the lean autograd path), in train mode."""
    data, _ = load_dataset("digits")
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        pick = rng.choice(len(data.y), 64, replace=False)
        _, grads = models.compute_gradients(model, data.x[pick], data.y[pick])
        params = models.get_params(model)
        models.set_params(model, {name: p - 0.1 * grads[name] if name in grads else p for name, p in params.items()})
    return model


def logits(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def card_for(model_path: Path, fmt: str, *, classes: tuple[str, ...] = DIGITS_CLASSES,
             input_shape: tuple[int, ...] = DIGITS_SHAPE, source: str = "", model_key: str = "digits-cnn",
             mean: tuple[float, ...] = (0.3055,), std: tuple[float, ...] = (0.3761,)) -> ModelCard:
    return ModelCard(job="digits", classes=classes, input_shape=input_shape, mean=mean, std=std, accuracy=0.9,
                     version=42, job_sha256="ab" * 32, format=fmt, file=model_path.name, model_key=model_key,
                     exported_at=time.time(), job_source=source)


def write_digit_images(folder: Path, count: int) -> tuple[list[Path], np.ndarray]:
    """``count`` held-out digits as PNGs (every other one 32x32 RGB, to be converted and resized) and their labels."""
    _, test = load_dataset("digits")
    paths: list[Path] = []
    for i in range(count):
        pixels = np.rint(test.x[i, 0] * 255).astype(np.uint8)
        image = Image.fromarray(pixels, mode="L")
        if i % 2:
            image = image.convert("RGB").resize((32, 32), Image.Resampling.NEAREST)
        paths.append(folder / f"digit-{i}.png")
        image.save(paths[-1])
    return paths, test.y[:count]


def predict(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["predict", *args])
    out, err = capsys.readouterr()
    return code, out, err


def parse_lines(out: str) -> dict[str, tuple[str, float]]:
    """``path  class (p=0.93)`` lines -> {path: (class, p)}."""
    result = {}
    for line in out.splitlines():
        path, _, top = line.partition("  ")
        name, _, p = top.partition(" (p=")
        result[path] = (name, float(p.rstrip(")")))
    return result


@pytest.fixture(scope="module")
def digits_model() -> torch.nn.Module:
    """The built-in digits CNN (Standardize first) after some training."""
    return train(models.build_model("digits-cnn"))


@pytest.fixture(scope="module")
def features_model() -> torch.nn.Module:
    """A layer-list model of (6,) feature vectors with a per-feature Standardize first, random weights."""
    models.register_spec(models.layer_list_spec(FEATURES_SPEC, [{"linear": 16}, "relu", {"linear": 3}],
                                                FEATURES_SHAPE, 3, mean=(0.5,) * 6, std=(0.25,) * 6))
    return models.build_model(FEATURES_SPEC, seed=3)


# --- ONNX ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["digits", "features"])
def test_onnx_logits_equal_torch_logits_for_any_batch_size(which: str, digits_model: torch.nn.Module,
                                                           features_model: torch.nn.Module, tmp_path: Path) -> None:
    model, shape = (digits_model, DIGITS_SHAPE) if which == "digits" else (features_model, FEATURES_SHAPE)
    model.train()
    path = export_model(model, shape, "onnx", tmp_path / "model.onnx")
    assert path == tmp_path / "model.onnx" and model.training, "export restores the module's mode"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"], "no partial file is left behind"

    graph = onnx.load(str(path))
    assert [i.name for i in graph.graph.input] == ["input"] and [o.name for o in graph.graph.output] == ["logits"]
    assert max(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")) >= 17
    assert all(n.domain in ("", "ai.onnx") for n in graph.graph.node), "no PythonOp of the lean autograd functions"
    ops = {n.op_type for n in graph.graph.node}
    assert {"Sub", "Div", "Relu"} <= ops, "standardization and ReLU are in the graph"
    batch_dim = graph.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.dim_value, "the batch dimension is dynamic"

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for batch in (1, 5, 13):
        x = rng.random((batch, *shape), dtype=np.float32)
        (got,) = session.run(["logits"], {"input": x})
        np.testing.assert_allclose(got, logits(model, x), rtol=0, atol=TOLERANCE)
    assert check_onnx(model, shape, path, samples=6) <= TOLERANCE


def test_check_onnx_sees_a_model_that_does_not_match(digits_model: torch.nn.Module, tmp_path: Path) -> None:
    path = export_model(digits_model, DIGITS_SHAPE, "onnx", tmp_path / "model.onnx")
    other = models.build_model("digits-cnn", seed=5)
    assert check_onnx(other, DIGITS_SHAPE, path) > 0.01


# --- safetensors and torch files --------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_state_dict_files_load_into_a_fresh_model(fmt: str, digits_model: torch.nn.Module, tmp_path: Path) -> None:
    path = export_model(digits_model, DIGITS_SHAPE, fmt, tmp_path / f"model.{fmt}")
    state = safetensors.torch.load_file(path) if fmt == "safetensors" else torch.load(path, weights_only=True)
    assert set(state) == set(digits_model.state_dict()), "parameters and buffers"
    assert {"input.mean", "input.std"} <= set(state)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in state.values())

    fresh = models.build_model("digits-cnn", seed=9)
    x = np.random.default_rng(2).random((7, *DIGITS_SHAPE), dtype=np.float32)
    assert not np.array_equal(logits(fresh, x), logits(digits_model, x))
    fresh.load_state_dict(state)
    np.testing.assert_array_equal(logits(fresh, x), logits(digits_model, x))


# --- model card -------------------------------------------------------------------------------


def test_the_model_card_is_written_beside_the_model_and_reads_back(digits_model: torch.nn.Module,
                                                                   tmp_path: Path) -> None:
    model_path = export_model(digits_model, DIGITS_SHAPE, "onnx", tmp_path / "shapes.onnx")
    mean, std = normalization(digits_model)
    assert mean == pytest.approx(models.DIGITS_MEAN_STD[0]) and std == pytest.approx(models.DIGITS_MEAN_STD[1])
    card = card_for(model_path, "onnx", source=TINY_JOB, mean=mean, std=std)
    written = write_card(card, model_path)
    assert written == tmp_path / "shapes.onnx.card.json" == card_path(model_path)
    assert written.name.endswith(CARD_SUFFIX)
    assert ModelCard.read(written) == card
    tree = json.loads(written.read_text())
    assert tree["classes"] == list(DIGITS_CLASSES) and tree["input_shape"] == [1, 8, 8]
    assert tree["file"] == "shapes.onnx" and tree["job_source"] == TINY_JOB
    assert normalization(models.build_model("digits-cnn").fc2) == ((), ())


@pytest.mark.parametrize(("content", "says"), [
    (None, "does not exist"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"job": "digits"}', "lacks classes"),
    ("WRONG_SHAPE", "input_shape must be"),
])
def test_a_missing_or_malformed_card_is_an_error_naming_it(content: str | None, says: str, tmp_path: Path) -> None:
    path = tmp_path / "m.onnx.card.json"
    if content == "WRONG_SHAPE":
        tree = json.loads(card_for(tmp_path / "m.onnx", "onnx").to_json())
        content = json.dumps({**tree, "input_shape": [1, 0, 8]})
    if content is not None:
        path.write_text(content)
    with pytest.raises(ExportError, match=says) as caught:
        ModelCard.read(path)
    assert str(path) in str(caught.value)


# --- export errors ----------------------------------------------------------------------------


def test_an_unknown_format_or_an_unwritable_path_is_an_export_error(digits_model: torch.nn.Module,
                                                                    tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="unknown export format 'tflite'; known: onnx, safetensors, torch"):
        export_model(digits_model, DIGITS_SHAPE, "tflite", tmp_path / "m.tflite")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for out, says in ((a_file / "m.onnx", "does not exist"), (tmp_path / "nowhere" / "m.onnx", "does not exist"),
                      (tmp_path, "is a directory")):
        for fmt in ("onnx", "safetensors", "torch"):
            with pytest.raises(ExportError, match=says):
                export_model(digits_model, DIGITS_SHAPE, fmt, out)
    with pytest.raises(ExportError, match="cannot write"):
        write_card(card_for(a_file / "m.onnx", "onnx"), a_file / "m.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize(("fmt", "package"), [("onnx", "onnx"), ("safetensors", "safetensors.torch")])
def test_a_missing_optional_package_says_how_to_install_it(fmt: str, package: str, digits_model: torch.nn.Module,
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    with pytest.raises(ExportError, match=r"is not installed: pip install 'edgemesh\[export\]'"):
        export_model(digits_model, DIGITS_SHAPE, fmt, tmp_path / f"m.{fmt}")
    assert not list(tmp_path.iterdir())


def test_predict_without_onnxruntime_says_how_to_install_it(digits_model: torch.nn.Module, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    model_path = export_model(digits_model, DIGITS_SHAPE, "onnx", tmp_path / "digits.onnx")
    write_card(card_for(model_path, "onnx"), model_path)
    (image,), _ = write_digit_images(tmp_path, 1)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    code, _, err = predict(str(model_path), str(image), capsys=capsys)
    assert code == 2 and "onnxruntime is not installed: pip install 'edgemesh[export]'" in err


# --- edgemesh predict -------------------------------------------------------------------------


def test_predict_with_an_onnx_model_prints_the_top_class_without_importing_torch(
        digits_model: torch.nn.Module, tmp_path: Path) -> None:
    model_path = export_model(digits_model, DIGITS_SHAPE, "onnx", tmp_path / "digits.onnx")
    write_card(card_for(model_path, "onnx"), model_path)
    images, labels = write_digit_images(tmp_path, 6)
    proc = subprocess.run([sys.executable, "-c", PREDICT_WITHOUT_TORCH, "predict", str(model_path),
                           *map(str, images)], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr

    expected = torch.softmax(torch.from_numpy(logits(digits_model, np.stack(
        [read_image(p, DIGITS_SHAPE) for p in images]))).double(), dim=1).numpy()
    printed = parse_lines(proc.stdout)
    assert list(printed) == [str(p) for p in images]
    for path, row in zip(images, expected, strict=True):
        name, p = printed[str(path)]
        assert name == DIGITS_CLASSES[int(row.argmax())]
        assert p == pytest.approx(row.max(), abs=0.005 + 1e-6)
    predicted = [int(printed[str(p)][0]) for p in images]
    assert len(set(predicted)) > 1 and sum(np.equal(predicted, labels)) >= 4, "the trained model tells digits apart"


def test_predict_json_lists_the_top_k_classes(digits_model: torch.nn.Module, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    model_path = export_model(digits_model, DIGITS_SHAPE, "onnx", tmp_path / "digits.onnx")
    write_card(card_for(model_path, "onnx"), model_path)
    images, _ = write_digit_images(tmp_path, 2)
    code, out, _ = predict(str(model_path), *map(str, images), "--top", "3", "--json", capsys=capsys)
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [row["input"] for row in rows] == [str(p) for p in images]
    for row, x in zip(rows, [read_image(p, DIGITS_SHAPE) for p in images], strict=True):
        probs = torch.softmax(torch.from_numpy(logits(digits_model, x[None])[0]).double(), dim=0).numpy()
        order = np.argsort(-probs)[:3]
        assert [t["class"] for t in row["top"]] == [DIGITS_CLASSES[i] for i in order]
        assert [t["p"] for t in row["top"]] == pytest.approx(probs[order].tolist(), abs=1e-5)


def test_predict_on_a_folder_classifies_every_image_below_it_in_batches(
        digits_model: torch.nn.Module, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder stands for its images at any depth, hidden ones left out, in name order; more of them than one
    batch are classified as they would be one by one."""
    model_path = export_model(digits_model, DIGITS_SHAPE, "onnx", tmp_path / "digits.onnx")
    write_card(card_for(model_path, "onnx"), model_path)
    photos = tmp_path / "photos"
    (photos / "day2").mkdir(parents=True)
    images, _ = write_digit_images(photos, PREDICT_BATCH + 6)
    moved = [p.rename(photos / "day2" / p.name) if i % 3 == 0 else p for i, p in enumerate(images)]
    (photos / ".thumbnails").mkdir()
    (photos / ".thumbnails" / "t.png").write_bytes(b"not read")
    (photos / ".digit-x.png").write_bytes(b"not read either")
    (photos / "notes.txt").write_text("not an input")
    code, out, err = predict(str(model_path), str(photos), capsys=capsys)
    assert code == 0, err
    printed = parse_lines(out)
    assert list(printed) == sorted(str(p) for p in moved)
    expected = torch.softmax(torch.from_numpy(logits(digits_model, np.stack(
        [read_image(p, DIGITS_SHAPE) for p in moved]))).double(), dim=1).numpy()
    for path, row in zip(moved, expected, strict=True):
        assert printed[str(path)] == (DIGITS_CLASSES[int(row.argmax())], pytest.approx(row.max(), abs=0.005 + 1e-6))
    (tmp_path / "empty" / ".hidden").mkdir(parents=True)
    code, out, err = predict(str(model_path), str(tmp_path / "empty"), capsys=capsys)
    assert (code, out) == (2, "") and "folder" in err and "holds no images" in err


def test_predict_takes_npy_arrays_of_the_input_shape(features_model: torch.nn.Module, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model_path = export_model(features_model, FEATURES_SHAPE, "onnx", tmp_path / "features.onnx")
    write_card(card_for(model_path, "onnx", classes=("a", "b", "c"), input_shape=FEATURES_SHAPE,
                        mean=(0.5,) * 6, std=(0.25,) * 6), model_path)
    rng = np.random.default_rng(4)
    floats, raw = rng.random(6, dtype=np.float32), rng.integers(0, 256, 6, dtype=np.uint8)
    np.save(tmp_path / "floats.npy", floats)
    np.save(tmp_path / "raw.npy", raw)
    inputs = [str(tmp_path / "floats.npy"), str(tmp_path / "raw.npy")]
    code, out, _ = predict(str(model_path), *inputs, "--top", "5", "--json", capsys=capsys)
    assert code == 0
    want = logits(features_model, np.stack([floats, raw.astype(np.float32) / 255]))
    for line, row in zip(out.splitlines(), want, strict=True):
        top = json.loads(line)["top"]
        assert len(top) == 3, "K is capped at the number of classes"
        assert top[0]["class"] == "abc"[int(row.argmax())]


CSV_JOB = """
[job]
name = "readings"

[model]
input_shape = [6]
classes = ["a", "b", "c"]
layers = [{linear = 16}, "relu", {linear = 3}]

[data]
format = "csv"
path = "readings.csv"
label_column = "kind"

[evaluation]
local_share = 0.2
"""
"""A CSV job whose class column is not the default ``label``."""


def test_predict_takes_a_csv_file_a_row_each_and_counts_the_rows_whose_label_it_gets_right(
        features_model: torch.nn.Module, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each row of a CSV is an input (named ``file:line``), read as a device reads its CSV data: every column but
    the job's label column a feature. Rows whose label is one of the classes are counted, right or wrong; a CSV
    without the label column is features alone."""
    model_path = export_model(features_model, FEATURES_SHAPE, "onnx", tmp_path / "features.onnx")
    write_card(card_for(model_path, "onnx", classes=("a", "b", "c"), input_shape=FEATURES_SHAPE, source=CSV_JOB,
                        mean=(0.5,) * 6, std=(0.25,) * 6), model_path)
    rng = np.random.default_rng(5)
    x = rng.random((PREDICT_BATCH + 3, 6), dtype=np.float32)
    want = logits(features_model, x).argmax(axis=1)
    kinds = ["abc"[i] for i in want]
    kinds[0] = "abc"[(want[0] + 1) % 3]  # labelled wrong
    kinds[1] = "?"  # not one of the classes: not counted
    header = "kind,f0,f1,f2,f3,f4,f5\n"  # the label column first: any place will do
    labelled = tmp_path / "readings.csv"
    labelled.write_text(header + "".join(f"{k}," + ",".join(f"{v:.8f}" for v in row) + "\n"
                                         for k, row in zip(kinds, x, strict=True)))
    bare = tmp_path / "bare.csv"
    bare.write_text("f0,f1,f2,f3,f4,f5\n" + ",".join(f"{v:.8f}" for v in x[0]) + "\n")
    code, out, err = predict(str(model_path), str(labelled), str(bare), capsys=capsys)
    assert code == 0, err
    printed = parse_lines(out)
    assert list(printed) == [f"{labelled}:{line}" for line in range(2, len(x) + 2)] + [f"{bare}:2"]
    assert [name for name, _ in printed.values()] == ["abc"[i] for i in want] + ["abc"[want[0]]]
    assert f"{len(x) - 2} of the {len(x) - 1} inputs that say their class predicted right" in err


def test_predict_takes_an_npz_archive_a_sample_each_and_counts_those_its_y_labels_right(
        features_model: torch.nn.Module, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A held-out ``.npz`` as a device's npz data is laid out (``x`` and class names or indices in ``y``): each sample
    an input (``file:INDEX``), read a chunk at a time, the right ones counted; one of ``x`` alone says no class;
    a Fortran-ordered ``x`` of whole-number floats and a uint8 ``x`` (scaled to [0, 1]) read as a device reads them."""
    model_path = export_model(features_model, FEATURES_SHAPE, "onnx", tmp_path / "features.onnx")
    write_card(card_for(model_path, "onnx", classes=("a", "b", "c"), input_shape=FEATURES_SHAPE,
                        mean=(0.5,) * 6, std=(0.25,) * 6), model_path)
    rng = np.random.default_rng(6)
    x = rng.random((PREDICT_BATCH + 5, 6), dtype=np.float32)
    want = logits(features_model, x).argmax(axis=1)
    y = np.array(["abc"[i] for i in want])
    y[0] = "abc"[(want[0] + 1) % 3]  # labelled wrong
    held_out = tmp_path / "held-out.npz"
    np.savez_compressed(held_out, x=np.asfortranarray(x.astype(np.float64)), y=y)
    raw = rng.integers(0, 256, (2, 6), dtype=np.uint8)
    bare = tmp_path / "bare.npz"
    np.savez(bare, x=raw)
    code, out, err = predict(str(model_path), str(held_out), str(bare), capsys=capsys)
    assert code == 0, err
    printed = parse_lines(out)
    assert list(printed) == [f"{held_out}:{i}" for i in range(len(x))] + [f"{bare}:0", f"{bare}:1"]
    raw_want = logits(features_model, raw.astype(np.float32) / 255).argmax(axis=1)
    assert [name for name, _ in printed.values()] == ["abc"[i] for i in [*want, *raw_want]]
    assert f"{len(x) - 1} of the {len(x)} inputs that say their class predicted right" in err
    for name, arrays, says in (("onehot.npz", {"x": x[:3], "y": np.eye(3)}, "not one-hot rows"),
                               ("names.npz", {"x": x[:2], "y": np.array(["a", "zebra"])}, "y[1] is not one of"),
                               ("nan.npz", {"x": np.where(np.arange(6) == 4, np.nan, x[:2]), "y": [0, 1]},
                                "x[0] holds non-finite values"),
                               ("shape.npz", {"x": x[:, :4]}, "x has shape")):
        np.savez(tmp_path / name, **arrays)
        code, out, err = predict(str(model_path), str(tmp_path / name), capsys=capsys)
        assert (code, out) == (2, ""), (name, err)
        assert name in err and says in err, (name, err)


def test_predict_counts_the_images_in_folders_named_after_a_class_it_gets_right(
        digits_model: torch.nn.Module, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A held-out image folder laid out as image-folder data (a folder per class): the last line says how many the
    model got right; images elsewhere say no class."""
    model_path = export_model(digits_model, DIGITS_SHAPE, "onnx", tmp_path / "digits.onnx")
    write_card(card_for(model_path, "onnx"), model_path)
    (tmp_path / "loose").mkdir()
    images, labels = write_digit_images(tmp_path / "loose", 12)
    for path, label in zip(images, labels, strict=True):
        (tmp_path / "held-out" / DIGITS_CLASSES[int(label)]).mkdir(parents=True, exist_ok=True)
        path.rename(tmp_path / "held-out" / DIGITS_CLASSES[int(label)] / path.name)
    code, out, err = predict(str(model_path), str(tmp_path / "held-out"), capsys=capsys)
    assert code == 0, err
    right = sum(name == str(Path(path).parent.name) for path, (name, _) in parse_lines(out).items())
    assert 0 < right and f"{right} of the 12 inputs that say their class predicted right" in err
    loose, _ = write_digit_images(tmp_path / "loose", 2)
    code, _, err = predict(str(model_path), *map(str, loose), capsys=capsys)
    assert code == 0 and "say their class" not in err


def test_a_csv_that_predict_cannot_read_is_named_with_its_line(features_model: torch.nn.Module, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    model_path = export_model(features_model, FEATURES_SHAPE, "onnx", tmp_path / "features.onnx")
    write_card(card_for(model_path, "onnx", classes=("a", "b", "c"), input_shape=FEATURES_SHAPE, source=CSV_JOB,
                        mean=(0.5,) * 6, std=(0.25,) * 6), model_path)
    cases = {"cell.csv": ("kind,f0,f1,f2,f3,f4,f5\na,1,2,3,x,5,6\n", "line 2, column 5: not a number"),
             "short.csv": ("kind,f0,f1,f2,f3,f4,f5\na,1,2,3\n", "line 2: 4 cells, the header has 7"),
             "wide.csv": ("kind,f0,f1\na,1,2\n", "has 2 feature columns besides 'kind'"),
             "nan.csv": ("f0,f1,f2,f3,f4,f5\n1,2,nan,4,5,6\n", "not a finite number"),
             "empty.csv": ("", "is empty; it needs a header row")}
    for name, (text, says) in cases.items():
        (tmp_path / name).write_text(text)
        code, out, err = predict(str(model_path), str(tmp_path / name), capsys=capsys)
        assert (code, out) == (2, ""), (name, err)
        assert name in err and says in err, (name, err)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_predict_rebuilds_a_state_dict_model_from_the_job_in_its_card(fmt: str, tmp_path: Path) -> None:
    job = parse_job(TINY_JOB)
    model_spec(job)
    model = train(models.build_model(job.model_key, seed=1))
    model_path = export_model(model, DIGITS_SHAPE, fmt, tmp_path / f"tiny.{fmt}")
    write_card(card_for(model_path, fmt, source=TINY_JOB, model_key=job.model_key, mean=(), std=()), model_path)
    images, _ = write_digit_images(tmp_path, 4)
    # A new process: the model is rebuilt from the card alone, not from this process's registry.
    proc = subprocess.run([sys.executable, "-m", "edgemesh", "predict", str(model_path), *map(str, images)],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    want = logits(model, np.stack([read_image(p, DIGITS_SHAPE) for p in images]))
    printed = parse_lines(proc.stdout)
    assert [printed[str(p)][0] for p in images] == [DIGITS_CLASSES[int(i)] for i in want.argmax(axis=1)]


def test_predict_errors_exit_2_and_name_the_file(digits_model: torch.nn.Module, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model_path = export_model(digits_model, DIGITS_SHAPE, "onnx", tmp_path / "digits.onnx")
    (good,), _ = write_digit_images(tmp_path, 1)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    np.save(tmp_path / "wrong.npy", np.zeros((8, 8), dtype=np.float32))
    (tmp_path / "notes.txt").write_text("hello")

    code, out, err = predict(str(model_path), str(good), capsys=capsys)
    assert (code, out) == (2, "") and f"model card '{model_path}.card.json' does not exist" in err
    code, _, err = predict(str(tmp_path / "missing.onnx"), str(good), capsys=capsys)
    assert code == 2 and "model file" in err and "missing.onnx" in err

    write_card(card_for(model_path, "onnx"), model_path)
    for bad, says in ((broken, f"image file '{broken}' cannot be read"),
                      (tmp_path / "gone.png", "gone.png"),
                      (tmp_path / "wrong.npy", "has shape (8, 8), the model takes (1, 8, 8)"),
                      (tmp_path / "notes.txt", "notes.txt' is neither an image")):
        code, out, err = predict(str(model_path), str(good), str(bad), capsys=capsys)
        assert (code, out) == (2, ""), err
        assert says in err
