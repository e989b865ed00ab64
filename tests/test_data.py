"""Datasets: the embedded digits, CIFAR pickles and image folders built here, synthetic data, seeded loaders."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from precsearch.errors import PrecsearchError
from precsearch.train.data import DATASETS, describe, load_dataset, make_loader, random_crop_flip


def _raw(dataset) -> torch.Tensor:
    """Undo the per-channel normalization."""
    return dataset.images * dataset.std.view(1, -1, 1, 1) + dataset.mean.view(1, -1, 1, 1)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_digits_shapes_split_and_normalization(digits) -> None:
    train, val = digits
    assert (len(train), len(val)) == (1437, 360)
    assert train.images.shape == (1437, 3, 32, 32) and val.images.shape == (360, 3, 32, 32)
    assert train.images.dtype == torch.float32 and train.labels.dtype == torch.int64
    assert train.num_classes == val.num_classes == 10
    assert torch.equal(train.images[:, 0], train.images[:, 2])  # grey replicated to 3 channels
    torch.testing.assert_close(train.images.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(train.images.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-5, rtol=0)
    # stratified: each class's validation share is 20% of that class, to within one image
    totals = np.bincount(load_digits().target, minlength=10)
    val_counts = np.bincount(val.labels.numpy(), minlength=10)
    assert np.all(np.abs(val_counts - 0.2 * totals) <= 1)


def _rows(images: torch.Tensor, labels: torch.Tensor) -> list[tuple]:
    grey = torch.round(images[:, 0].reshape(len(images), -1) * 16).to(torch.int64)
    return sorted(tuple(row) + (int(label),) for row, label in zip(grey.tolist(), labels.tolist(), strict=True))


def test_digits_split_partitions_the_real_images() -> None:
    train, val = load_dataset("digits", image_size=8)  # no resize: pixels are sklearn's 0..16 levels / 16
    bunch = load_digits()
    expected = sorted(tuple(row) + (int(label),) for row, label in
                      zip(bunch.images.reshape(len(bunch.images), -1).astype(int).tolist(), bunch.target, strict=True))
    assert sorted(_rows(_raw(train), train.labels) + _rows(_raw(val), val.labels)) == expected


def test_digits_resize_is_bilinear() -> None:
    small, _ = load_dataset("digits", image_size=8)
    large, _ = load_dataset("digits", image_size=32)
    assert torch.equal(small.labels, large.labels)  # the split does not depend on the size
    p, q = _raw(small)[5, 0], _raw(large)[5, 0]
    # align_corners=False, scale 4: output index o samples source (o + 0.5) / 4 - 0.5
    # row 6 -> 1.125 (rows 1, 2 weighted 7/8, 1/8); column 9 -> 1.875 (columns 1, 2 weighted 1/8, 7/8)
    expected = (0.875 * (0.125 * p[1, 1] + 0.875 * p[1, 2]) + 0.125 * (0.125 * p[2, 1] + 0.875 * p[2, 2]))
    assert abs(float(q[6, 9]) - float(expected)) < 1e-5


def test_digits_split_is_seeded(digits) -> None:
    again, _ = load_dataset("digits")
    other, _ = load_dataset("digits", seed=1)
    assert torch.equal(digits[0].images, again.images) and torch.equal(digits[0].labels, again.labels)
    assert not torch.equal(digits[0].labels, other.labels)


def _write_pickle(path: Path, obj) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=2))


def _cifar_dir(root: Path, name: str, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, list[int]]]:
    """A tiny CIFAR tree in the python-pickle layout; returns the raw arrays by file name."""
    if name == "cifar10":
        folder, files, label_key, meta = "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + [
            "test_batch"], b"labels", ("batches.meta", b"label_names", 10)
    else:
        folder, files, label_key, meta = "cifar-100-python", ["train", "test"], b"fine_labels", (
            "meta", b"fine_label_names", 100)
    base = root / folder
    base.mkdir(parents=True)
    written = {}
    for i, file in enumerate(files):
        count = 3 + i
        data = rng.integers(0, 256, size=(count, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, meta[2], size=count)]
        entry = {b"data": data, label_key: labels, b"batch_label": file.encode()}
        if name == "cifar100":
            entry[b"coarse_labels"] = [v // 5 for v in labels]
        _write_pickle(base / file, entry)
        written[file] = (data, labels)
    _write_pickle(base / meta[0], {meta[1]: [f"class{i}".encode() for i in range(meta[2])]})
    return written


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_loader_reads_the_pickle_layout(tmp_path: Path, name: str) -> None:
    written = _cifar_dir(tmp_path, name, np.random.default_rng(0))
    train_files = [f for f in written if f not in ("test_batch", "test")]
    test_file = "test_batch" if name == "cifar10" else "test"
    train, val = load_dataset(name, root=tmp_path)
    assert len(train) == sum(len(written[f][1]) for f in train_files)
    assert len(val) == len(written[test_file][1])
    assert train.num_classes == (10 if name == "cifar10" else 100) and train.classes[3] == "class3"
    data = np.concatenate([written[f][0] for f in train_files])
    labels = sum((written[f][1] for f in train_files), [])
    assert train.labels.tolist() == labels and val.labels.tolist() == written[test_file][1]
    raw = _raw(train)
    # CIFAR rows are 1024 red, 1024 green, 1024 blue values, each 32 x 32 row-major
    for n, c, y, x in [(0, 0, 0, 0), (1, 2, 31, 5), (len(labels) - 1, 1, 7, 30)]:
        assert abs(float(raw[n, c, y, x]) - data[n, c * 1024 + y * 32 + x] / 255) < 1e-5
    assert abs(float(_raw(val)[0, 1, 2, 3]) - written[test_file][0][0, 1024 + 2 * 32 + 3] / 255) < 1e-5


def test_cifar_root_may_be_the_batches_folder_and_images_resize(tmp_path: Path) -> None:
    _cifar_dir(tmp_path, "cifar10", np.random.default_rng(1))
    train, val = load_dataset("cifar10", root=tmp_path / "cifar-10-batches-py", image_size=16)
    assert train.images.shape[1:] == (3, 16, 16) and val.images.shape[1:] == (3, 16, 16)


def test_cifar_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(PrecsearchError, match="--data-root"):
        load_dataset("cifar10")
    with pytest.raises(PrecsearchError, match="does not exist"):
        load_dataset("cifar10", root=tmp_path / "nope")
    with pytest.raises(PrecsearchError, match="is empty"):
        load_dataset("cifar10", root=tmp_path)
    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    _write_pickle(base / "data_batch_1", {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]})
    with pytest.raises(PrecsearchError, match="lacks data_batch_2, .*, data_batch_5, test_batch"):
        load_dataset("cifar10", root=tmp_path)


@pytest.mark.parametrize(("entry", "fragment"), [
    ({b"data": np.zeros((2, 3072), np.uint8)}, "has keys ['data']"),
    ({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, "(2, 100)"),
    ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, "float32"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "1 labels"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, "outside 0..9"),
    ([1, 2, 3], "holds a list"),
])
def test_cifar_wrong_content_is_one_line(tmp_path: Path, entry, fragment: str) -> None:
    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    good = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}
    for file in [f"data_batch_{i}" for i in range(1, 6)]:
        _write_pickle(base / file, good)
    _write_pickle(base / "test_batch", entry)
    with pytest.raises(PrecsearchError) as info:
        load_dataset("cifar10", root=tmp_path)
    assert fragment in str(info.value) and "\n" not in str(info.value)


class _Touch:
    """Pickles to a call that would create a file, to prove the loader never runs pickled code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_cifar_pickle_with_code_is_refused(tmp_path: Path) -> None:
    _cifar_dir(tmp_path, "cifar10", np.random.default_rng(2))
    marker = tmp_path / "executed"
    _write_pickle(tmp_path / "cifar-10-batches-py" / "test_batch", {b"data": _Touch(marker), b"labels": [0]})
    with pytest.raises(PrecsearchError, match="refusing to load"):
        load_dataset("cifar10", root=tmp_path)
    assert not marker.exists()


def _image_tree(root: Path, layout: dict[str, dict[str, list[tuple[int, int, int]]]]) -> None:
    for split, classes in layout.items():
        for class_name, colors in classes.items():
            folder = root / split / class_name
            folder.mkdir(parents=True)
            for i, color in enumerate(colors):
                Image.new("RGB", (12, 10), color).save(folder / f"img{i}.png")


def test_image_folder_loads_classes_and_pixels(tmp_path: Path) -> None:
    _image_tree(tmp_path, {
        "train": {"cat": [(255, 0, 0), (0, 255, 0)], "dog": [(0, 0, 255)]},
        "val": {"cat": [(10, 20, 30)], "dog": [(40, 50, 60)]},
    })
    (tmp_path / "train" / "dog" / "notes.txt").write_text("ignored")
    train, val = load_dataset("imagefolder", root=tmp_path, image_size=8)
    assert train.classes == ("cat", "dog") and train.labels.tolist() == [0, 0, 1] and val.labels.tolist() == [0, 1]
    assert train.images.shape == (3, 3, 8, 8)
    raw = _raw(val)  # solid colours survive resizing exactly
    torch.testing.assert_close(raw[1, :, 4, 4], torch.tensor([40, 50, 60]) / 255.0, atol=1e-5, rtol=0)
    torch.testing.assert_close(raw[0, :, 0, 7], torch.tensor([10, 20, 30]) / 255.0, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("layout", "fragment"), [
    ({"train": {"cat": [(1, 1, 1)]}}, "has no val/ folder"),
    ({"train": {"cat": [(1, 1, 1)]}, "val": {"cow": [(1, 1, 1)]}}, "classes cow that train/ lacks"),
    ({"train": {}, "val": {"cat": [(1, 1, 1)]}}, "has no class folders holding images"),
    ({"train": {"cat": [(1, 1, 1)]}, "val": {"cat": []}}, "holds no images"),
])
def test_image_folder_layout_errors(tmp_path: Path, layout, fragment: str) -> None:
    (tmp_path / "train").mkdir()
    _image_tree(tmp_path, layout)
    with pytest.raises(PrecsearchError) as info:
        load_dataset("imagefolder", root=tmp_path)
    assert fragment in str(info.value) and str(tmp_path) in str(info.value)


def test_image_folder_unreadable_image_is_named(tmp_path: Path) -> None:
    _image_tree(tmp_path, {"train": {"cat": [(1, 2, 3)]}, "val": {"cat": [(1, 2, 3)]}})
    broken = tmp_path / "train" / "cat" / "broken.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(PrecsearchError, match="broken.png"):
        load_dataset("imagefolder", root=tmp_path)


def test_synthetic_is_seeded_and_sized() -> None:
    train, val = load_dataset("synthetic", image_size=12, num_classes=4, train_size=40, val_size=9, seed=5)
    again, _ = load_dataset("synthetic", image_size=12, num_classes=4, train_size=40, val_size=9, seed=5)
    other, _ = load_dataset("synthetic", image_size=12, num_classes=4, train_size=40, val_size=9, seed=6)
    assert train.images.shape == (40, 3, 12, 12) and val.images.shape == (9, 3, 12, 12)
    assert train.num_classes == 4 and set(train.labels.tolist()) <= {0, 1, 2, 3}
    assert torch.equal(train.images, again.images) and not torch.equal(train.images, other.images)


def test_unknown_dataset_and_misplaced_options() -> None:
    with pytest.raises(PrecsearchError) as info:
        load_dataset("mnist")
    assert all(name in str(info.value) for name in DATASETS)
    with pytest.raises(PrecsearchError, match="num_classes, root do not apply to dataset digits"):
        load_dataset("digits", root="x", num_classes=3)
    with pytest.raises(PrecsearchError, match="image_size=0"):
        load_dataset("synthetic", image_size=0)
    with pytest.raises(PrecsearchError, match="val_fraction=1.5"):
        load_dataset("digits", val_fraction=1.5)
    assert set(describe()) == set(DATASETS)


def test_make_loader_order_depends_only_on_its_seed() -> None:
    train, _ = load_dataset("synthetic", train_size=50, val_size=1)

    def order(seed: int, global_seed: int) -> list[int]:
        torch.manual_seed(global_seed)  # the global RNG must not matter
        return torch.cat([labels for _, labels in make_loader(train, 16, seed=seed)]).tolist()

    first = order(0, global_seed=1)
    assert first == order(0, global_seed=2) != order(1, global_seed=1)
    assert sorted(first) == sorted(train.labels.tolist())
    images, labels = next(iter(make_loader(train, 16, shuffle=False)))
    assert images.shape == (16, 3, 32, 32) and torch.equal(labels, train.labels[:16])
    assert len(make_loader(train, 16, drop_last=True)) == 3


def test_random_crop_flip_pads_black_crops_and_flips_each_image_as_drawn() -> None:
    images = torch.randn(6, 3, 16, 16)
    mean, std = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.5, 0.25, 2.0])
    out = random_crop_flip(images, mean, std, torch.Generator().manual_seed(7))
    # the same draws, one image at a time, with torch's own padding and flipping
    generator = torch.Generator().manual_seed(7)
    pad = 16 // 8
    top = torch.randint(0, 2 * pad + 1, (6,), generator=generator)
    left = torch.randint(0, 2 * pad + 1, (6,), generator=generator)
    flip = torch.rand(6, generator=generator) < 0.5
    for i in range(6):
        raw = images[i] * std.view(3, 1, 1) + mean.view(3, 1, 1)  # back to pixel values: black is 0
        padded = torch.nn.functional.pad(raw, (pad, pad, pad, pad), value=0.0)
        crop = padded[:, top[i]:top[i] + 16, left[i]:left[i] + 16]
        crop = crop.flip(-1) if flip[i] else crop
        assert torch.allclose(out[i], (crop - mean.view(3, 1, 1)) / std.view(3, 1, 1), atol=1e-6)
    assert 0 < int(flip.sum()) < 6 and len(set(top.tolist())) > 1  # the draws vary
