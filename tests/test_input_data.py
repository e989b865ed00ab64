"""Data files are data, limits come before work, and messages say what is wrong (issue: trust boundaries).

CIFAR labels that are not class numbers, protocol-5 pickles, oversized images, a class without val images, a
negative number with an exponent, a file where a folder goes, paths in printed commands, and the temporary
file of an atomic write: each is read correctly or refused in one line (exit 2, no traceback) that names the
user's file, and nothing is written."""

from __future__ import annotations

import errno
import os
import pickle
import shlex
import struct
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from precsearch.cli import main
from precsearch.cli.search import summarize
from precsearch.files import atomic_write_text, full_disk
from precsearch.train.data import load_dataset

FAST = ["--image-size", "8", "--device", "cpu", "--threads", "1"]
TRAIN = ["train", "tiny_cnn", "--steps", "1", *FAST]
TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]


def _one_error_line(argv: list[str], capsys) -> str:
    """The single ``error:`` line main printed for ``argv`` after exiting 2 (argparse exits through SystemExit,
    after its usage lines)."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err and "Warning" not in err, err
    return errors[0]


def _cifar10(root: Path, test_labels, protocol: int = 2) -> dict[str, tuple[np.ndarray, list]]:
    """A CIFAR-10 tree of two images per file, pickled with ``protocol``; test_batch has ``test_labels``."""
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for file in [*TRAIN_FILES, "test_batch"]:
        data = rng.integers(0, 256, size=(2, 3072), dtype=np.uint8)
        labels = test_labels if file == "test_batch" else [int(v) for v in rng.integers(0, 10, size=2)]
        (base / file).write_bytes(pickle.dumps({b"data": data, b"labels": labels}, protocol=protocol))
        written[file] = (data, labels)
    return written


# --- 1. CIFAR labels must be integers in [0, classes)


@pytest.mark.parametrize(("labels", "shown"), [
    ([float("nan"), 0], "label nan of image 0 is not an integer"),
    (np.array([[0], [1]]), "label [0] of image 0 is not an integer"),
    ([0, 2**70], "label 1180591620717411303424 of image 1 is outside 0..9"),
    ([3.7, 0], "label 3.7 of image 0 is not an integer"),
    (np.array([1.0, 2.0]), "label 1.0 of image 0 is not an integer"),
    (["7", 0], "label '7' of image 0 is not an integer"),
    ([True, 0], "label True of image 0 is not an integer"),
    ([0, -1], "label -1 of image 1 is outside 0..9"),
])
def test_cifar_labels_that_are_not_class_numbers_are_refused_in_one_line(tmp_path, capsys, labels, shown):
    _cifar10(tmp_path, labels)
    line = _one_error_line([*TRAIN, "--data", "cifar10", "--data-root", str(tmp_path)], capsys)
    assert f"{tmp_path / 'cifar-10-batches-py' / 'test_batch'}: {shown}" in line


def test_cifar_integer_labels_of_any_integer_type_are_read_as_written(tmp_path):
    _cifar10(tmp_path, np.array([9, 4], dtype=np.uint8))
    _, val = load_dataset("cifar10", root=tmp_path)
    assert val.labels.dtype == torch.int64 and val.labels.tolist() == [9, 4]


# --- 2. CIFAR pickles of protocol 5 (numpy arrays as in-band buffers)


def test_cifar_pickles_of_protocol_5_are_read(tmp_path):
    written = _cifar10(tmp_path, [7, 2], protocol=5)
    assert b"_frombuffer" in (tmp_path / "cifar-10-batches-py" / "test_batch").read_bytes()  # the protocol-5 form
    train, val = load_dataset("cifar10", root=tmp_path)
    assert val.labels.tolist() == [7, 2]
    assert train.labels.tolist() == sum((written[f][1] for f in TRAIN_FILES), [])
    raw = val.images * val.std.view(1, -1, 1, 1) + val.mean.view(1, -1, 1, 1)
    expected = torch.from_numpy(written["test_batch"][0].reshape(2, 3, 32, 32).astype(np.float32) / 255)
    torch.testing.assert_close(raw, expected, atol=1e-5, rtol=0)


def test_cifar_pickles_of_protocol_5_with_objects_or_out_of_band_buffers_are_refused(tmp_path, capsys):
    _cifar10(tmp_path, [0, 1], protocol=5)
    test_batch = tmp_path / "cifar-10-batches-py" / "test_batch"
    # any object but an array passes the same allow-list at protocol 5 (a path: rebuilt by calling its class)
    test_batch.write_bytes(pickle.dumps({b"data": tmp_path, b"labels": [0]}, protocol=5))
    line = _one_error_line([*TRAIN, "--data", "cifar10", "--data-root", str(tmp_path)], capsys)
    assert f"cannot read {test_batch}: refusing to load pathlib" in line
    buffers: list = []
    data = np.zeros((2, 3072), np.uint8)
    test_batch.write_bytes(pickle.dumps({b"data": data, b"labels": [0, 1]}, protocol=5, buffer_callback=buffers.append))
    assert buffers  # the array's bytes are not in the file
    line = _one_error_line([*TRAIN, "--data", "cifar10", "--data-root", str(tmp_path)], capsys)
    assert f"cannot read {test_batch}" in line and "out-of-band" in line


# --- 3. images too large to decode are refused from their header


def _png_header(path: Path, width: int, height: int) -> None:
    """A PNG whose header says ``width`` x ``height`` and whose pixel data is one byte: Pillow opens it (reading
    the header), decoding it fails."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0"))
                     + chunk(b"IEND", b""))


def _image_tree(root: Path, counts: dict[str, dict[str, int]]) -> None:
    """root/<split>/<class>/img<i>.png, solid 4x4 images, ``counts[split][class]`` of them."""
    for split, classes in counts.items():
        for name, count in classes.items():
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (4, 4), (10 * i, 20, 30)).save(root / split / name / f"img{i}.png")


@pytest.mark.parametrize("side", [20000, 10000])  # past twice Pillow's limit (it raises), and past it (it warns)
def test_an_image_over_the_pixel_limit_is_refused_from_its_header(tmp_path, capsys, side):
    _image_tree(tmp_path, {"train": {"cat": 1}, "val": {"cat": 1}})
    big = tmp_path / "train" / "cat" / "zbig.png"
    _png_header(big, side, side)
    assert side * side > Image.MAX_IMAGE_PIXELS
    line = _one_error_line([*TRAIN, "--data", "imagefolder", "--data-root", str(tmp_path)], capsys)
    assert f"image {big} is too large to decode: Image size ({side * side} pixels) exceeds limit" in line
    _png_header(big, 200, 200)  # the same file of a small size is decoded, and its missing pixels found
    line = _one_error_line([*TRAIN, "--data", "imagefolder", "--data-root", str(tmp_path)], capsys)
    assert f"cannot read image {big} (image file is truncated" in line


# --- 4. every train class needs val images


def test_a_class_without_val_images_is_refused_by_name(tmp_path, capsys):
    _image_tree(tmp_path, {"train": {"cat": 2, "dog": 2, "eel": 1}, "val": {"cat": 1, "eel": 0}})
    line = _one_error_line([*TRAIN, "--data", "imagefolder", "--data-root", str(tmp_path)], capsys)
    assert f"{tmp_path / 'val'} holds no images of class dog, eel; give every train class val images" in line


# --- 5. negative numbers with exponents are values, and -1e39 rounds with each format's overflow


def test_formats_rounds_negative_numbers_with_exponents(capsys, caplog):
    assert main(["formats", "e5m2", "e4m3b4s", "--round", "-1e39", "-1e-3", "-inf"]) == 0
    header, *rows = capsys.readouterr().out.strip().splitlines()
    assert header.split() == ["x", "e5m2", "(overflow", "inf)", "e4m3b4s", "(overflow", "saturate)"]
    # -1e39 is beyond float32 (max 3.4e38): it is -inf before rounding, which e5m2 keeps and e4m3b4s (no inf,
    # max 30 = 1.875 * 2**4) saturates; 0.001 lies in [2**-10, 2**-9), where both formats' step is 2**-12 and
    # 0.001 / 2**-12 = 4.096 rounds to 4, giving 2**-10 = 0.0009765625
    assert [row.split() for row in rows] == [["-inf", "-inf", "-30"], ["-0.001", "-0.0009765625", "-0.0009765625"],
                                             ["-inf", "-inf", "-30"]]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "-1e+39: beyond float32's range, rounded as infinite (every format is simulated in float32)")]


def test_a_negative_number_with_an_exponent_reaches_the_range_check(capsys):
    line = _one_error_line([*TRAIN, "--lr", "-1e-3"], capsys)
    assert "--lr: '-1e-3': give a number > 0" in line


# --- 6. a file where a folder goes


def test_a_file_where_a_folder_goes_is_named(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    search = ["search", "tiny_cnn", "--proxy-steps", "2", "--no-progress", *FAST, "--out"]
    assert _one_error_line([*search, "/dev/null"], capsys).endswith("error: --out /dev/null is not a directory; "
                                                                    "give a folder")
    for argv in ([*search, str(afile / "sub")], [*search, str(afile / "sub" / "deeper")],
                 [*TRAIN, "--metrics", str(afile / "sub" / "m.csv")]):
        assert _one_error_line(argv, capsys).endswith(f"error: {afile} is a file, not a directory; choose another path")
    line = _one_error_line([*TRAIN, "--metrics", "/dev/null/m.csv"], capsys)
    assert line.endswith("error: /dev/null is not a directory; choose another path")
    assert afile.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["afile"]


# --- 7. paths in printed commands are quoted


def test_the_printed_report_command_quotes_the_run_directory(tmp_path):
    out = tmp_path / "my runs" / "it's $HOME"
    result = SimpleNamespace(trials=pd.DataFrame({"state": ["COMPLETE"], "diverged": [False]}), calibration=None,
                             pareto=pd.DataFrame(), noise=None, confirmation=None, best=None, budget=None,
                             note="none", out_dir=out, wall_time=1.0)
    command = summarize(result).rsplit("plot with: ", 1)[1]
    assert shlex.split(command) == ["precsearch", "report", str(out)]


# --- 8. an atomic write's failure names the user's file, not its temporary


def test_a_failed_atomic_write_names_the_users_file(tmp_path, capsys):
    target = tmp_path / "graph.json"
    target.mkdir()  # a folder where the file goes: the rename of the temporary onto it fails
    line = _one_error_line(["trace", "tiny_cnn", "--json", str(target)], capsys)
    assert line == f"precsearch trace: error: Is a directory: {target}; check the path, its permissions and free space"
    assert [p.name for p in tmp_path.iterdir()] == ["graph.json"] and not any(target.iterdir())


def test_a_temporary_that_cannot_be_created_is_not_named(tmp_path, monkeypatch):
    def full(name, *args):
        raise OSError(errno.ENOSPC, "No space left on device", str(name))

    with monkeypatch.context() as patched, pytest.raises(OSError) as info:
        patched.setattr(os, "open", full)
        atomic_write_text(tmp_path / "x.json", "{}")
    assert info.value.filename == str(tmp_path / "x.json") and info.value.filename2 is None
    assert full_disk(info.value) is info.value  # still recognized as a full disk


def test_a_ctrl_c_as_the_temporary_is_created_leaves_nothing_behind(tmp_path, monkeypatch):
    """A KeyboardInterrupt the moment the temporary exists, before the write knows its descriptor (a SIGINT
    between two bytecodes): the temporary is removed and the file keeps its old contents."""
    target = tmp_path / "run.json"
    target.write_text("old")
    real_open = os.open

    def interrupted(name, *args):
        real_open(name, *args)
        raise KeyboardInterrupt

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        patched.setattr(os, "open", interrupted)
        atomic_write_text(target, "new")
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"] and target.read_text() == "old"


@pytest.mark.parametrize(("data", "size", "count"), [("digits", 1500, 1797), ("gratings", 2000, 3072),
                                                    ("imagefolder", 2200, 20)])
def test_a_dataset_outgrowing_memory_at_its_image_size_is_refused_before_any_image_is_made(
        tmp_path, capsys, monkeypatch, data, size, count):
    """Priced as the OS counts memory (``os.sysconf``, faked to 1 GiB so that the sizes stay small): the float32
    images alone (count x 3 x size**2 x 4 bytes) outgrow it, though one batch of one image fits, and nothing is
    resized or drawn (interpolate and Pillow's resize are made to fail)."""
    import os

    sysconf = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PHYS_PAGES": 2**18, "SC_PAGE_SIZE": 4096}.get(name)
                        or sysconf(name))
    monkeypatch.setattr(torch.nn.functional, "interpolate", None)
    monkeypatch.setattr(Image.Image, "resize", None)
    root = []
    if data == "imagefolder":
        _image_tree(tmp_path, {"train": {"cat": 8, "dog": 7}, "val": {"cat": 3, "dog": 2}})
        root = ["--data-root", str(tmp_path)]
    needed = count * 3 * size**2 * 4 / 2**30
    line = _one_error_line(["train", "tiny_cnn", "--data", data, *root, "--image-size", str(size), "--batch-size", "1",
                            "--device", "cpu", "--threads", "1"], capsys)
    assert f"images of 3x{size}x{size} need at least {needed:.3g} GiB" in line and "--image-size" in line, line
