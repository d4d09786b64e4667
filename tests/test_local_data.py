"""Tests for edgemesh.common.data.local: a device's own data (image folders, CSV, npz) and its held-out split."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edgemesh.common import data as data_package
from edgemesh.common.data import DATA_FORMATS, IMAGE_SUFFIXES, MAX_SKIPPED_SHARE, LocalData, load_local, read_image
from edgemesh.common.errors import DataError

CLASSES = ["circle", "square", "triangle"]
COLOURS = {"circle": (255, 0, 0), "square": (0, 255, 0), "triangle": (0, 0, 255)}

# --------------------------------------------------------------------------- helpers


def _solid(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (6, 4), mode: str = "RGB") -> Path:
    """Write a solid image of ``size`` (width, height); the format follows the suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", size, colour)
    (image if mode == "RGB" else image.convert(mode)).save(path)
    return path


def _image_folder(root: Path, counts: dict[str, int], suffix: str = ".png") -> Path:
    """``root/<class>/<i><suffix>``: ``counts[class]`` solid images of the class's colour."""
    for name, count in counts.items():
        for i in range(count):
            _solid(root / name / f"{i}{suffix}", COLOURS.get(name, (9, 9, 9)))
    return root


def _write_csv(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    lines = [",".join(header)] + [",".join(str(cell) for cell in row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _indexed_npz(path: Path, counts: list[int]) -> Path:
    """An npz of (N, 1, 2, 2) samples, sample i filled with the value i, ``counts[c]`` samples of class c."""
    y = np.repeat(np.arange(len(counts)), counts)
    x = np.repeat(np.arange(y.size, dtype=np.float64), 4).reshape(-1, 1, 2, 2)
    np.savez(path, x=x, y=y)
    return path


def _sample_ids(x: np.ndarray) -> list[int]:
    """The index each sample of an ``_indexed_npz`` was filled with."""
    return [int(v) for v in x[:, 0, 0, 0]]


def _raises(match_names: list[str], fmt: str, path: Path, **kwargs: object) -> DataError:
    """Load and expect a DataError whose message names every one of ``match_names``."""
    kwargs.setdefault("input_shape", (3, 4, 6))
    kwargs.setdefault("classes", CLASSES)
    with pytest.raises(DataError) as info:
        load_local(fmt, path, **kwargs)  # type: ignore[arg-type]
    for name in match_names:
        assert name in str(info.value), f"{name!r} not in {info.value}"
    return info.value


def test_package_exports_the_local_api() -> None:
    assert DATA_FORMATS == ("image-folder", "csv", "npz")
    assert IMAGE_SUFFIXES == (".png", ".jpg", ".jpeg")
    for name in ("DATA_FORMATS", "IMAGE_SUFFIXES", "LocalData", "load_local", "read_image"):
        assert name in data_package.__all__


# --------------------------------------------------------------------------- image folders


def test_image_folder_labels_follow_class_names_not_folder_order(tmp_path: Path) -> None:
    root = _image_folder(tmp_path / "shapes", {"circle": 3, "square": 2, "triangle": 1})
    classes = ["triangle", "circle", "square"]  # not alphabetical: labels must come from the names
    local = load_local("image-folder", root, input_shape=(3, 4, 6), classes=classes)
    assert isinstance(local, LocalData) and local.validation is None
    train = local.train
    assert train.x.shape == (6, 3, 4, 6) and train.x.dtype == np.float32 and train.y.dtype == np.int64
    assert train.y.tolist() == [1, 1, 1, 2, 2, 0]  # folders read in sorted order: circle, square, triangle
    assert train.num_classes == 3 and train.name == f"image-folder:{root}"
    for x, label in zip(train.x, train.y, strict=True):
        expected = np.array(COLOURS[classes[label]], dtype=np.float32)[:, None, None] / 255
        np.testing.assert_allclose(x, np.broadcast_to(expected, (3, 4, 6)), atol=1e-6)
    assert local.class_counts == {"triangle": 1, "circle": 3, "square": 2}


def test_image_folder_device_lacking_a_class_loads_and_omits_it(tmp_path: Path) -> None:
    root = _image_folder(tmp_path, {"circle": 2, "triangle": 1})
    local = load_local("image-folder", root, input_shape=(3, 4, 6), classes=CLASSES)
    assert local.train.y.tolist() == [0, 0, 2]
    assert local.train.num_classes == 3
    assert local.class_counts == {"circle": 2, "triangle": 1}


def test_image_folder_reads_jpeg_and_upper_case_suffixes_and_ignores_other_files(tmp_path: Path) -> None:
    root = _image_folder(tmp_path, {"square": 1}, suffix=".jpg")
    _solid(root / "square" / "B.JPEG", COLOURS["square"])
    _solid(root / "square" / "C.Png", COLOURS["square"])
    (root / "square" / "notes.txt").write_text("not an image")
    (root / "square" / ".hidden.png").write_bytes(b"garbage, but hidden")
    (root / "square" / "empty").mkdir()
    (root / ".cache").mkdir()  # a hidden folder is not a class
    (root / ".DS_Store").write_bytes(b"\x00\x01")
    (root / "README").write_text("files beside the class folders are ignored")
    local = load_local("image-folder", root, input_shape=(3, 4, 6), classes=CLASSES)
    assert local.train.y.tolist() == [1, 1, 1]
    green = local.train.x[:, 1]
    assert green.min() > 0.9 and local.train.x[:, [0, 2]].max() < 0.1  # JPEG is lossy, but still green


def test_image_folder_reads_a_class_folders_subfolders_but_not_hidden_ones(tmp_path: Path) -> None:
    """A class folder as a camera or a phone fills it (``circle/DCIM/100MEDIA/...``): every image below it is the
    class's, but for hidden folders (``.thumbnails``); a link back up is read once, not forever."""
    root = _image_folder(tmp_path, {"circle": 1, "square": 1})
    _solid(root / "circle" / "DCIM" / "100MEDIA" / "a.jpg", COLOURS["circle"])
    _solid(root / "circle" / "DCIM" / "b.png", COLOURS["circle"])
    _solid(root / "circle" / ".thumbnails" / "t.png", COLOURS["square"])
    (root / "circle" / "DCIM" / "again").symlink_to(root / "circle")
    local = load_local("image-folder", root, input_shape=(3, 4, 6), classes=CLASSES)
    assert local.class_counts == {"circle": 3, "square": 1}
    assert local.train.y.tolist() == [0, 0, 0, 1]
    reds = local.train.x[:3, 0]
    assert reds.min() > 0.9  # the thumbnail (green) is not among them


def test_read_image_channels_and_resize(tmp_path: Path) -> None:
    rgb = _solid(tmp_path / "rgb.png", (200, 100, 50), size=(10, 20))
    as_gray = read_image(rgb, (1, 20, 10))
    assert as_gray.shape == (1, 20, 10) and as_gray.dtype == np.float32
    luma = (200 * 299 + 100 * 587 + 50 * 114) / 1000  # Pillow's RGB -> L conversion
    assert as_gray[0, 0, 0] == pytest.approx(round(luma) / 255, abs=1 / 255)
    gray = _solid(tmp_path / "gray.png", (77, 77, 77), mode="L")
    as_rgb = read_image(gray, (3, 4, 6))
    assert as_rgb.shape == (3, 4, 6)
    np.testing.assert_allclose(as_rgb, 77 / 255, atol=1e-6)  # one grey value in all three channels

    half = np.zeros((8, 8), dtype=np.uint8)
    half[:, 4:] = 255  # left half black, right half white
    Image.fromarray(half, mode="L").save(tmp_path / "half.png")
    small = read_image(tmp_path / "half.png", (1, 2, 4))  # (H, W) = (2, 4): resized, not cropped
    assert small.shape == (1, 2, 4)
    assert small.min() >= 0.0 and small.max() <= 1.0
    assert small[0, :, 0].max() < 0.1 and small[0, :, 3].min() > 0.9


def test_a_16_bit_grayscale_png_is_read_by_its_own_range_not_clipped_to_white(tmp_path: Path) -> None:
    """A sensor's or depth camera's 16-bit PNG (Pillow mode ``I;16``): its values over 65,535, in every channel the
    model takes; Pillow's own conversion to 8 bits turned every value above 255 white."""
    ramp = np.tile(np.linspace(0, 65535, 8).astype(np.uint16), (4, 1))  # dark on the left, white on the right
    Image.fromarray(ramp).save(tmp_path / "depth.png")
    assert Image.open(tmp_path / "depth.png").mode in ("I;16", "I")
    gray = read_image(tmp_path / "depth.png", (1, 4, 8))
    np.testing.assert_allclose(gray[0], ramp / 65535, atol=1e-6)
    rgb = read_image(tmp_path / "depth.png", (3, 2, 4))  # resized, and the same in every channel
    assert rgb.shape == (3, 2, 4) and rgb.dtype == np.float32
    assert rgb[:, :, 0].max() < 0.25 and rgb[:, :, 3].min() > 0.75
    np.testing.assert_array_equal(rgb[0], rgb[2])


def test_read_image_refuses_other_channel_counts_and_unreadable_files(tmp_path: Path) -> None:
    image = _solid(tmp_path / "ok.png", (1, 2, 3))
    with pytest.raises(DataError, match="channels"):
        read_image(image, (2, 4, 6))
    with pytest.raises(DataError, match="C, H, W"):
        read_image(image, (4, 6))
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(DataError, match="broken.jpg"):
        read_image(broken, (3, 4, 6))


def test_image_folder_errors_name_the_folder_file_or_path(tmp_path: Path) -> None:
    root = _image_folder(tmp_path / "data", {"circle": 1, "hexagon": 1})
    error = _raises(["hexagon", "circle, square, triangle"], "image-folder", root)
    assert "hexagon" in str(error)

    root = _image_folder(tmp_path / "garbled", {"circle": 1})
    (root / "square").mkdir()
    (root / "square" / "x.png").write_bytes(b"these bytes are not a PNG")
    _raises([str(root), "1 of the 2 image files", "'square/x.png'"], "image-folder", root)

    empty = tmp_path / "empty"
    (empty / "circle").mkdir(parents=True)
    (empty / "circle" / "notes.txt").write_text("no images here")
    _raises([str(empty), "no images"], "image-folder", empty)

    _raises([str(tmp_path / "nowhere"), "does not exist"], "image-folder", tmp_path / "nowhere")
    a_file = _solid(tmp_path / "one.png", (0, 0, 0))
    _raises([str(a_file), "not a directory"], "image-folder", a_file)
    _raises(["channels"], "image-folder", _image_folder(tmp_path / "ok", {"circle": 1}), input_shape=(2, 4, 6))


def test_an_unreadable_image_is_skipped_and_counted_up_to_the_share(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """One broken photo among twenty (5 %, ``MAX_SKIPPED_SHARE``) is skipped and counted, not a reason to drop the
    device's data; the log says how many and which."""
    root = tmp_path / "shapes"
    for i in range(10):
        _solid(root / "circle" / f"{i}.png", COLOURS["circle"])
    for i in range(9):
        _solid(root / "square" / f"{i}.jpg", COLOURS["square"])
    (root / "square" / "broken.jpg").write_bytes(b"\xff\xd8 a JPEG cut short by a full SD card")
    with caplog.at_level("WARNING", logger="edgemesh.common.data.images"):
        local = load_local("image-folder", root, input_shape=(3, 4, 6), classes=CLASSES)
    assert MAX_SKIPPED_SHARE == 0.05
    assert local.train.y.tolist() == [0] * 10 + [1] * 9 and local.class_counts == {"circle": 10, "square": 9}
    assert (local.skipped, local.first_skipped) == (1, "square/broken.jpg")
    assert local.train.x[10:, 1].min() > 0.9  # the JPEGs read are the squares'
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "skipped 1 of the 20 image files" in warned[0] and "square/broken.jpg" in warned[0]

    # the share is a parameter: a PNG, a JPEG and a corrupt file pass at a half, not at the default
    small = tmp_path / "small"
    _solid(small / "circle" / "a.png", COLOURS["circle"])
    _solid(small / "square" / "b.jpeg", COLOURS["square"])
    (small / "square" / "c.png").write_bytes(b"\x89PNG\r\n\x1a\n and then nothing")
    half = load_local("image-folder", small, input_shape=(3, 4, 6), classes=CLASSES, max_skipped_share=0.5)
    assert half.train.y.tolist() == [0, 1] and (half.skipped, half.first_skipped) == (1, "square/c.png")
    _raises(["1 of the 3 image files", "more than the 5%", "'square/c.png'"], "image-folder", small)
    _raises(["max_skipped_share"], "image-folder", small, max_skipped_share=1.5)
    clean = load_local("image-folder", _image_folder(tmp_path / "clean", {"circle": 2}), input_shape=(3, 4, 6),
                       classes=CLASSES)
    assert (clean.skipped, clean.first_skipped) == (0, "")


def test_a_folder_of_mostly_unreadable_images_is_refused_naming_how_many_and_the_first(tmp_path: Path) -> None:
    root = tmp_path / "shapes"
    _solid(root / "circle" / "ok.png", COLOURS["circle"])
    _solid(root / "triangle" / "ok.jpg", COLOURS["triangle"])
    for name in ("a.png", "b.jpg", "c.jpeg"):
        (root / "square" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "square" / name).write_bytes(b"not an image at all")
    error = _raises([str(root), "3 of the 5 image files", "'square/a.png'"], "image-folder", root)
    assert str(root / "square" / "a.png") not in str(error)  # named relative to the data folder

    everything = tmp_path / "all-broken"
    (everything / "circle").mkdir(parents=True)
    (everything / "circle" / "x.png").write_bytes(b"")
    _raises(["1 of the 1 image files", "'circle/x.png'"], "image-folder", everything)


# --------------------------------------------------------------------------- CSV


def test_csv_loads_features_reshaped_and_labels_by_name(tmp_path: Path) -> None:
    header = ["f0", "f1", "label", "f2", "f3", "f4", "f5"]  # the label column need not come last
    rows: list[list[object]] = [
        [0, 1, "square", 2, 3, 4, 5],
        [0.5, -1, "circle", 1e-3, " 7", 8, 9],
        [1, 1, "square", 1, 1, 1, 1],
    ]
    path = _write_csv(tmp_path / "readings.csv", header, rows)
    local = load_local("csv", path, input_shape=(2, 3), classes=CLASSES)
    train = local.train
    assert train.x.shape == (3, 2, 3) and train.x.dtype == np.float32
    np.testing.assert_allclose(train.x[0], [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_allclose(train.x[1], [[0.5, -1.0, 1e-3], [7.0, 8.0, 9.0]], rtol=1e-6)
    assert train.y.tolist() == [1, 0, 1] and train.y.dtype == np.int64
    assert train.name == f"csv:{path}" and train.num_classes == 3
    assert local.class_counts == {"square": 2, "circle": 1}

    flat = load_local("csv", path, input_shape=(6,), classes=CLASSES)  # (N, F): plain feature rows
    assert flat.train.x.shape == (3, 6)


def test_csv_custom_label_column_and_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "excel.csv"
    path.write_bytes("\ufeffkind,a,b\r\ntriangle,1,2\r\n\r\ncircle,3,4\r\n".encode())
    local = load_local("csv", path, input_shape=(2,), classes=CLASSES, label_column="kind")
    assert local.train.y.tolist() == [2, 0]
    np.testing.assert_array_equal(local.train.x, [[1, 2], [3, 4]])


@pytest.mark.parametrize(
    ("rows", "names", "hidden"),
    [
        ([["circle", 1, 2], ["hexagon", 3, 4]], ["line 3, column 1", "not one of the job's classes"], "hexagon"),
        ([["circle", 1, 2], ["square", "abc", 4]], ["line 3, column 2", "not a number"], "abc"),
        ([["circle", 1, ""]], ["line 2, column 3", "not a number"], "''"),
        ([["circle", 1, "nan"]], ["line 2, column 3", "finite"], "nan"),
        ([["circle", 1, "1e39"]], ["line 2, column 3", "float32"], "1e39"),
        ([["circle", 1, 2, 3]], ["line 2", "4 cells"], "circle"),
    ],
)
def test_csv_bad_cells_name_file_line_and_column(tmp_path: Path, rows: list[list[object]], names: list[str],
                                                 hidden: str) -> None:
    """The error says where (file, line, column by number), never what the file holds: a cell, or the header's
    column names (a device publishes the error where every device reads it)."""
    path = _write_csv(tmp_path / "bad.csv", ["label", "a", "b"], rows)
    error = str(_raises([str(path), *names], "csv", path, input_shape=(2,)))
    assert hidden not in error and "'a'" not in error and "'b'" not in error


def test_csv_column_count_must_match_input_shape(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "wide.csv", ["label", "a", "b", "c", "d", "e"], [["circle", 1, 2, 3, 4, 5]])
    error = _raises([str(path), "5 feature columns", "needs 6"], "csv", path, input_shape=(2, 3))
    assert "(2, 3)" in str(error)


def test_csv_missing_label_column_empty_file_and_not_utf8(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "nolabel.csv", ["a", "b"], [[1, 2]])
    _raises([str(path), "'label'"], "csv", path, input_shape=(2,))
    _raises([str(path), "'klass'"], "csv", path, input_shape=(1,), label_column="klass")
    assert "semicolons" not in str(_raises([str(path)], "csv", path, input_shape=(2,)))
    semicolons = tmp_path / "excel.csv"  # a spreadsheet's export in a locale whose decimal mark is a comma
    semicolons.write_text("label;a;b\ncircle;1,5;2\n")
    error = str(_raises([str(semicolons), "no label column 'label'", "one column", "semicolons"], "csv", semicolons,
                        input_shape=(2,)))
    assert "label;a;b" not in error  # the header's text stays on the device
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    _raises([str(empty), "header"], "csv", empty, input_shape=(2,))
    header_only = _write_csv(tmp_path / "header-only.csv", ["label", "a"], [])
    _raises([str(header_only), "no samples"], "csv", header_only, input_shape=(1,))
    latin = tmp_path / "latin1.csv"
    latin.write_bytes("label,a\ncircle,1\ncarr\xe9,2\n".encode("latin-1"))
    _raises([str(latin), "UTF-8"], "csv", latin, input_shape=(1,))
    _raises([str(tmp_path), "not a file"], "csv", tmp_path, input_shape=(1,))
    _raises([str(tmp_path / "gone.csv"), "does not exist"], "csv", tmp_path / "gone.csv", input_shape=(1,))


# --------------------------------------------------------------------------- npz


def test_npz_loads_full_and_flat_shapes_with_integer_or_name_labels(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 2, 3, 3))
    np.savez(tmp_path / "full.npz", x=x, y=np.array([0, 2, 2, 1, 0]))
    full = load_local("npz", tmp_path / "full.npz", input_shape=(2, 3, 3), classes=CLASSES)
    assert full.train.x.shape == (5, 2, 3, 3) and full.train.x.dtype == np.float32
    np.testing.assert_allclose(full.train.x, x.astype(np.float32))
    assert full.train.y.tolist() == [0, 2, 2, 1, 0] and full.train.name == f"npz:{tmp_path / 'full.npz'}"

    np.savez(tmp_path / "flat.npz", x=x.reshape(5, 18), y=np.array(["square", "square", "circle", "square", "circle"]))
    flat = load_local("npz", tmp_path / "flat.npz", input_shape=(2, 3, 3), classes=CLASSES)
    np.testing.assert_allclose(flat.train.x, x.astype(np.float32))
    assert flat.train.y.tolist() == [1, 1, 0, 1, 0]
    assert flat.class_counts == {"circle": 2, "square": 3}


def test_npz_uint8_is_scaled_and_other_integers_are_cast(tmp_path: Path) -> None:
    pixels = np.array([[0, 51, 255, 128]], dtype=np.uint8).repeat(3, axis=0)
    np.savez(tmp_path / "u8.npz", x=pixels, y=np.array([0, 1, 2], dtype=np.uint8))
    local = load_local("npz", tmp_path / "u8.npz", input_shape=(1, 2, 2), classes=CLASSES)
    np.testing.assert_allclose(local.train.x[0, 0], [[0, 0.2], [1, 128 / 255]], rtol=1e-6)
    np.savez(tmp_path / "i16.npz", x=pixels.astype(np.int16), y=np.array([0, 1, 2]))
    raw = load_local("npz", tmp_path / "i16.npz", input_shape=(4,), classes=CLASSES)
    assert raw.train.x.max() == 255.0  # only uint8 means 8-bit pixels


def test_npz_errors_name_the_file_and_the_problem(tmp_path: Path) -> None:
    def npz(name: str, **arrays: np.ndarray) -> Path:
        np.savez(tmp_path / name, **arrays)  # type: ignore[arg-type]
        return tmp_path / name

    good_x, good_y = np.zeros((3, 4)), np.array([0, 1, 2])
    path = npz("no-x.npz", y=good_y)
    _raises([str(path), "'x'"], "npz", path, input_shape=(4,))
    path = npz("no-y.npz", x=good_x)
    _raises([str(path), "'y'"], "npz", path, input_shape=(4,))
    path = npz("shape.npz", x=np.zeros((3, 5)), y=good_y)
    _raises([str(path), "(3, 5)", "(N, 2, 2)", "(N, 4)"], "npz", path, input_shape=(2, 2))
    path = npz("range.npz", x=good_x, y=np.array([0, 3, 1]))
    _raises([str(path), "y[1] is a class index outside [0, 3)"], "npz", path, input_shape=(4,))
    path = npz("names.npz", x=good_x, y=np.array(["circle", "hexagon", "square"]))
    error = _raises([str(path), "y[1] is not one of the job's class names"], "npz", path, input_shape=(4,))
    assert "hexagon" not in str(error)  # a value of the file, never published
    path = npz("nan.npz", x=np.array([[0, 1, np.nan, 2], [0, 0, 0, np.inf], [1, 1, 1, 1]]), y=good_y)
    _raises([str(path), "non-finite"], "npz", path, input_shape=(4,))
    path = npz("ylen.npz", x=good_x, y=np.array([0, 1]))
    _raises([str(path), "y has shape (2,)"], "npz", path, input_shape=(4,))
    path = npz("yfrac.npz", x=good_x, y=np.array([0.0, 1.5, 2.0]))
    error = _raises([str(path), "y[1] is not a whole number (a class index)"], "npz", path, input_shape=(4,))
    assert "1.5" not in str(error)  # a value of the file, never published
    path = npz("onehot.npz", x=good_x, y=np.eye(3))
    _raises([str(path), "y has shape (3, 3)", "not one-hot rows"], "npz", path, input_shape=(4,))
    path = npz("ycomplex.npz", x=good_x, y=np.array([0, 1, 2], dtype=np.complex64))
    _raises([str(path), "complex64"], "npz", path, input_shape=(4,))


def test_npz_labels_as_whole_floats_a_column_or_booleans_are_class_indices(tmp_path: Path) -> None:
    """Labels as pandas stores a column with gaps (float64 whole numbers), as a column vector (N, 1), or as booleans
    (classes 0 and 1) are class indices."""
    x = np.zeros((3, 4))
    for name, y, want in (("float.npz", np.array([2.0, 0.0, 1.0]), [2, 0, 1]),
                          ("column.npz", np.array([[1], [2], [0]]), [1, 2, 0]),
                          ("flag.npz", np.array([True, False, True]), [1, 0, 1])):
        np.savez(tmp_path / name, x=x, y=y)
        assert load_local("npz", tmp_path / name, input_shape=(4,), classes=CLASSES).train.y.tolist() == want, name


def test_npz_refuses_pickled_arrays_and_garbage(tmp_path: Path) -> None:
    pickled = tmp_path / "pickled.npz"
    objects = np.array([{"evil": 1}, None, "x"], dtype=object)
    np.savez(pickled, x=np.zeros((3, 4)), y=objects)  # y is stored as a pickle
    _raises([str(pickled), "cannot be read"], "npz", pickled, input_shape=(4,))
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"certainly not a zip archive")
    _raises([str(garbage), "cannot be read"], "npz", garbage, input_shape=(4,))
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(pickled.read_bytes()[:100])
    _raises([str(truncated), "cannot be read"], "npz", truncated, input_shape=(4,))
    single = tmp_path / "single.npy"
    np.save(single, np.zeros((3, 4)))
    _raises([str(single), "single array"], "npz", single, input_shape=(4,))


# --------------------------------------------------------------------------- validation and caps


def test_validation_split_is_per_class_disjoint_and_sized(tmp_path: Path) -> None:
    path = _indexed_npz(tmp_path / "d.npz", [10, 4, 1])
    local = load_local("npz", path, input_shape=(1, 2, 2), classes=CLASSES, validation_share=0.2, seed=5)
    assert local.validation is not None
    val, train = local.validation, local.train
    # circle: round(0.2 * 10) = 2; square: round(0.8) = 1; triangle has one sample and stays in train
    assert np.bincount(val.y, minlength=3).tolist() == [2, 1, 0]
    assert np.bincount(train.y, minlength=3).tolist() == [8, 3, 1]
    train_ids, val_ids = _sample_ids(train.x), _sample_ids(val.x)
    assert not set(train_ids) & set(val_ids)
    assert sorted(train_ids + val_ids) == list(range(15))
    labels = np.repeat(np.arange(3), [10, 4, 1])
    assert val.y.tolist() == labels[val_ids].tolist()  # each sample keeps its own label
    assert val.num_classes == 3 and val.name != train.name
    assert local.class_counts == {"circle": 10, "square": 4, "triangle": 1}


def test_validation_split_is_deterministic_per_seed(tmp_path: Path) -> None:
    path = _indexed_npz(tmp_path / "d.npz", [20, 20])

    def held_out(seed: int) -> list[int]:
        local = load_local("npz", path, input_shape=(1, 2, 2), classes=CLASSES, validation_share=0.25, seed=seed)
        assert local.validation is not None
        return sorted(_sample_ids(local.validation.x))

    assert held_out(3) == held_out(3)
    assert held_out(3) != held_out(4)
    assert len(held_out(3)) == 10


def test_validation_takes_at_least_one_per_class(tmp_path: Path) -> None:
    path = _indexed_npz(tmp_path / "d.npz", [3, 2, 0])
    local = load_local("npz", path, input_shape=(1, 2, 2), classes=CLASSES, validation_share=0.1)
    assert local.validation is not None
    assert np.bincount(local.validation.y, minlength=3).tolist() == [1, 1, 0]  # round(0.3) and round(0.2) are 0


@pytest.mark.parametrize("share", [-0.1, 1.0, 1.5, math.nan])
def test_validation_share_out_of_range(tmp_path: Path, share: float) -> None:
    path = _indexed_npz(tmp_path / "d.npz", [3, 3])
    _raises(["validation_share"], "npz", path, input_shape=(1, 2, 2), validation_share=share)


def test_validation_that_would_be_empty_or_leave_no_training_data(tmp_path: Path) -> None:
    singles = _indexed_npz(tmp_path / "singles.npz", [1, 1, 1])
    _raises(["no validation samples"], "npz", singles, input_shape=(1, 2, 2), validation_share=0.5)
    pair = _indexed_npz(tmp_path / "pair.npz", [2])
    _raises(["no training samples"], "npz", pair, input_shape=(1, 2, 2), validation_share=0.9)  # round(1.8) = 2


def test_max_samples_keeps_a_seeded_subset(tmp_path: Path) -> None:
    path = _indexed_npz(tmp_path / "d.npz", [12, 8])

    def capped(seed: int, cap: int, share: float = 0.0) -> LocalData:
        return load_local(
            "npz", path, input_shape=(1, 2, 2), classes=CLASSES, max_samples=cap, seed=seed, validation_share=share
        )

    five = capped(1, 5)
    ids = _sample_ids(five.train.x)
    assert len(five.train) == 5 and len(set(ids)) == 5 and set(ids) <= set(range(20))
    assert five.train.y.tolist() == [0 if i < 12 else 1 for i in ids]
    assert _sample_ids(capped(1, 5).train.x) == ids
    assert _sample_ids(capped(2, 5).train.x) != ids
    assert sum(five.class_counts.values()) == 5
    assert len(capped(1, 100).train) == 20 and len(capped(1, 0).train) == 20
    split = capped(1, 10, share=0.2)
    assert split.validation is not None and len(split.train) + len(split.validation) == 10
    assert sum(split.class_counts.values()) == 10


# --------------------------------------------------------------------------- arguments


def test_bad_arguments(tmp_path: Path) -> None:
    path = _indexed_npz(tmp_path / "d.npz", [3, 3])
    _raises(["classes"], "npz", path, input_shape=(1, 2, 2), classes=[])
    _raises(["classes"], "npz", path, input_shape=(1, 2, 2), classes=["a", "b", "a"])
    _raises(["classes"], "npz", path, input_shape=(1, 2, 2), classes="abc")
    _raises(["parquet", "image-folder, csv, npz"], "parquet", path)
    _raises(["input_shape"], "npz", path, input_shape=())
    _raises(["input_shape"], "npz", path, input_shape=(0, 4))
    _raises(["max_samples"], "npz", path, input_shape=(1, 2, 2), max_samples=-1)
