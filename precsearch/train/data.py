"""Image classification datasets for proxy and full training, all held in memory as float32 tensors.

`load_dataset(name, ...)` returns `(train, val)`: `ImageDataset`s of images (N, 3, H, W) normalized per
channel with the training split's mean and std, and int64 labels. Names:

- `digits` (default, no download): scikit-learn's bundled 1,797 handwritten 8x8 digits, resized bilinearly
  to `image_size`, replicated to 3 channels, split train/val by a seeded stratified draw (1,437 / 360).
- `cifar10` / `cifar100`: the python-pickle layout under `root` (`cifar-10-batches-py/data_batch_1..5` and
  `test_batch`; `cifar-100-python/train` and `test`, fine labels), any pickle protocol; only numpy arrays and
  plain values are unpickled, and labels must be integers in [0, classes). The test set serves as validation.
- `imagefolder`: `root/train/<class>/*.png|jpg|...` and `root/val/<class>/...`, read with Pillow; every class
  needs val images, and an image over Pillow's pixel limit is refused from its header.
- `synthetic`: seeded Gaussian images with a per-class pattern added (so it is learnable), for speed tests.
- `gratings`: seeded faint gratings on a bright background, where low precision hurts (the demo's task).

Nothing is downloaded and nothing is cached on disk. `make_loader` wraps a dataset in a DataLoader whose
shuffling comes from an explicit seed; `random_crop_flip` is full training's augmentation (padded random crop
and horizontal flip, per image, seeded), applied to each training batch.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import reprlib
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from precsearch.errors import PrecsearchError

__all__ = ["DATASETS", "ImageDataset", "describe", "load_dataset", "make_loader", "random_crop_flip"]

log = logging.getLogger(__name__)

_DESCRIPTIONS = {
    "digits": "scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes); no download",
    "cifar10": "CIFAR-10 python-pickle files under --data-root (cifar-10-batches-py); never downloaded",
    "cifar100": "CIFAR-100 python-pickle files under --data-root (cifar-100-python), fine labels",
    "imagefolder": "root/train/<class>/*.png|jpg and root/val/<class>/*, resized to the image size",
    "synthetic": "seeded random images with a per-class pattern, for speed tests",
    "gratings": "seeded faint gratings (10 orientation x frequency classes) on bright random backgrounds; "
                "discriminates precision assignments (the demo's task)",
}
DATASETS: tuple[str, ...] = tuple(_DESCRIPTIONS)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


class ImageDataset(TensorDataset):
    """Images (N, 3, H, W) float32, normalized per channel, and int64 labels; knows its class names."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, classes: Sequence[str],
                 mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__(images, labels)
        self.images, self.labels, self.classes, self.mean, self.std = images, labels, tuple(classes), mean, std

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        channels, height, width = self.images.shape[1:]
        return channels, height, width


def describe() -> dict[str, str]:
    """One line per dataset name, for CLI help."""
    return dict(_DESCRIPTIONS)


def _check_fits(count: int, image_size: int) -> None:
    """Refuse, before any image is made at ``image_size``, a dataset whose float32 images alone outgrow this
    machine's memory (``--image-size 1500`` on digits would want 48 GB)."""
    from precsearch.models import machine_memory

    needed, memory = count * 3 * image_size**2 * 4, machine_memory()
    if needed > memory:
        raise PrecsearchError(f"{count} images of 3x{image_size}x{image_size} need at least {needed / 2**30:.3g} GiB "
                              f"as float32, more than this machine's {memory / 2**30:.3g} GiB of memory; give a "
                              "smaller --image-size")


def _resize(images: torch.Tensor, image_size: int) -> torch.Tensor:
    """Bilinear resize of (N, C, H, W) float images to square `image_size` (antialiased when shrinking)."""
    _check_fits(images.shape[0], image_size)
    if tuple(images.shape[-2:]) == (image_size, image_size):
        return images
    return F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False,
                         antialias=True)


def _normalized_pair(train_images: torch.Tensor, train_labels: torch.Tensor, val_images: torch.Tensor,
                     val_labels: torch.Tensor, classes: Sequence[str]) -> tuple[ImageDataset, ImageDataset]:
    """Normalize both splits by the train split's per-channel mean and std (std 1 for a constant channel)."""
    mean = train_images.mean(dim=(0, 2, 3))
    std = train_images.std(dim=(0, 2, 3))
    std = torch.where(std > 0, std, torch.ones_like(std))
    shape = (1, -1, 1, 1)

    def make(images: torch.Tensor, labels: torch.Tensor) -> ImageDataset:
        normalized = ((images - mean.view(shape)) / std.view(shape)).to(torch.float32).contiguous()
        return ImageDataset(normalized, labels.to(torch.int64), classes, mean, std)

    return make(train_images, train_labels), make(val_images, val_labels)


def _uint8_to_float(images: np.ndarray, image_size: int) -> torch.Tensor:
    """(N, 3, H, W) uint8 -> float32 in [0, 1], resized."""
    return _resize(torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32).div_(255.0), image_size)


def _load_digits(image_size: int, seed: int, val_fraction: float) -> tuple[ImageDataset, ImageDataset]:
    """sklearn's digits (0..16 grey levels) scaled to [0, 1], resized, 3 channels, stratified seeded split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = torch.from_numpy(bunch.images).to(torch.float32).div_(16.0).unsqueeze(1)
    images = _resize(images, image_size).expand(-1, 3, -1, -1)
    labels = torch.from_numpy(bunch.target).to(torch.int64)
    train_idx, val_idx = train_test_split(np.arange(len(labels)), test_size=val_fraction,
                                          stratify=bunch.target, random_state=seed)
    train_idx, val_idx = torch.from_numpy(np.sort(train_idx)), torch.from_numpy(np.sort(val_idx))
    classes = [str(c) for c in bunch.target_names]
    return _normalized_pair(images[train_idx], labels[train_idx], images[val_idx], labels[val_idx], classes)


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that only rebuilds numpy arrays, so a tampered dataset file cannot run code."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
        # protocol 5 stores an array's bytes in-band (a bytearray) and rebuilds it with frombuffer and reshape
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only numpy arrays are expected")
        return super().find_class(module, name)


def _cifar_labels(value: Any, path: Path, count: int) -> np.ndarray:
    """A CIFAR file's labels as int64, each checked to be an integer in [0, count): numpy's own conversion
    would truncate 3.7 to 3, parse "7", and fail with a traceback on nan or 2**70."""
    items = value.tolist() if isinstance(value, np.ndarray) else value
    if not isinstance(items, list | tuple):
        raise PrecsearchError(f"{path} holds labels of type {type(items).__name__}; expected a list of class "
                              f"numbers 0..{count - 1}, one per image")
    for row, label in enumerate(items):
        if isinstance(label, bool) or not isinstance(label, int | np.integer):
            problem = "is not an integer"
        elif not 0 <= label < count:
            problem = f"is outside 0..{count - 1}"
        else:
            continue
        raise PrecsearchError(f"{path}: label {reprlib.repr(label)} of image {row} {problem}; expected class "
                              f"numbers 0..{count - 1}, one per image")
    return np.asarray(items, dtype=np.int64)


def _read_cifar_file(path: Path, label_key: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR pickle -> (N, 3, 32, 32) uint8 images and int64 labels in [0, count); errors name the file."""
    expected = f"a CIFAR python pickle dict with 'data' (N x 3072 uint8) and '{label_key}'"
    try:
        with path.open("rb") as handle:
            raw = _ArrayUnpickler(handle, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as exc:
        raise PrecsearchError(f"cannot read {path}: {exc}; expected {expected}") from exc
    if not isinstance(raw, dict):
        raise PrecsearchError(f"{path} holds a {type(raw).__name__}; expected {expected}")
    entry = {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in raw.items()}
    if "data" not in entry or label_key not in entry:
        raise PrecsearchError(f"{path} has keys {sorted(map(str, entry))}; expected {expected}")
    data = np.asarray(entry["data"])
    labels = _cifar_labels(entry[label_key], path, count)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise PrecsearchError(f"{path} has data {data.dtype} {data.shape} and {len(labels)} labels; "
                              f"expected {expected}, one label per row")
    return data.reshape(-1, 3, 32, 32), labels


def _read_label_names(path: Path, key: str, count: int) -> list[str]:
    """Class names from the meta file when present and sane, else '0', '1', ..."""
    fallback = [str(i) for i in range(count)]
    if not path.is_file():
        return fallback
    try:
        with path.open("rb") as handle:
            raw = _ArrayUnpickler(handle, encoding="latin1").load()
        names = {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in raw.items()}[key]
        names = [n.decode("latin1") if isinstance(n, bytes) else str(n) for n in names]
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError) as exc:
        log.warning("ignoring class names in %s (%s); using numbers", path, exc)
        return fallback
    return names if len(names) == count else fallback


_CIFAR_LAYOUT = {
    # name: (folder, train files, test file, label key, meta file, names key, class count)
    "cifar10": ("cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "labels",
                "batches.meta", "label_names", 10),
    "cifar100": ("cifar-100-python", ("train",), "test", "fine_labels", "meta", "fine_label_names", 100),
}


def _require_directory(root: str | os.PathLike[str] | None, name: str, expected: str) -> Path:
    """`root` as a Path that exists, is a directory and is not empty; one-line errors otherwise."""
    if root is None:
        raise PrecsearchError(f"dataset {name} reads local files; give the folder that holds {expected} "
                              "(--data-root DIR)")
    path = Path(root).expanduser()
    if not path.exists():
        raise PrecsearchError(f"dataset directory {path} does not exist; expected a folder with {expected}")
    if not path.is_dir():
        raise PrecsearchError(f"dataset path {path} is not a directory; expected a folder with {expected}")
    if not any(path.iterdir()):
        raise PrecsearchError(f"dataset directory {path} is empty; expected {expected}")
    return path


def _load_cifar(name: str, root: str | os.PathLike[str] | None, image_size: int) -> tuple[ImageDataset, ImageDataset]:
    folder, train_files, test_file, label_key, meta_file, names_key, count = _CIFAR_LAYOUT[name]
    expected = f"{folder}/ with {', '.join(train_files)} and {test_file}"
    path = _require_directory(root, name, expected)
    base = path / folder if (path / folder).is_dir() else path
    missing = [f for f in (*train_files, test_file) if not (base / f).is_file()]
    if missing:
        raise PrecsearchError(f"{base} lacks {', '.join(missing)}; expected the {name} layout: {expected}")
    train = [_read_cifar_file(base / f, label_key, count) for f in train_files]
    test_images, test_labels = _read_cifar_file(base / test_file, label_key, count)
    train_images = np.concatenate([images for images, _ in train])
    train_labels = np.concatenate([labels for _, labels in train])
    classes = _read_label_names(base / meta_file, names_key, count)
    return _normalized_pair(_uint8_to_float(train_images, image_size), torch.from_numpy(train_labels),
                            _uint8_to_float(test_images, image_size), torch.from_numpy(test_labels), classes)


def _image_files(split_dir: Path, classes: Sequence[str]) -> list[list[Path]]:
    """The image files of each class under split_dir/<class>/, sorted."""
    return [sorted(p for p in (split_dir / name).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if (split_dir / name).is_dir() else [] for name in classes]


def _read_image_folder(files_of: list[list[Path]], image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every image of ``files_of`` (a list of files per class) as (N, 3, size, size) float32 in [0, 1] and its class
    index. An image over Pillow's decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``, 89M pixels) is refused from its
    header, before it is decoded: Pillow raises past twice the limit and only warns below, so its warning is made an
    error here."""
    from PIL import Image, UnidentifiedImageError

    images, labels = [], []
    for index, files in enumerate(files_of):
        for file in files:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", Image.DecompressionBombWarning)
                    with Image.open(file) as image:
                        images.append(_image_pixels(image, image_size, file))
            except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
                raise PrecsearchError(f"image {file} is too large to decode: {str(exc).rstrip('.')}; shrink it or "
                                      "remove it") from exc
            except (UnidentifiedImageError, OSError) as exc:
                raise PrecsearchError(f"cannot read image {file} ({exc}); remove it or replace it") from exc
            labels.append(index)
    if not images:
        return np.zeros((0, 3, image_size, image_size), np.float32), np.zeros(0, np.int64)
    return np.stack(images), np.asarray(labels, dtype=np.int64)


def _image_pixels(image: Any, image_size: int, file: Path) -> np.ndarray:
    """One image as (3, size, size) float32 in [0, 1], resized bilinearly. A 16-bit greyscale image (Pillow's
    ``I;16`` modes) is read at its 16 bits, from 0 to 65535: ``convert("RGB")`` would clip it to 255. 32-bit
    integer or float pixels (modes ``I``, ``F``) have no range to scale by, so they are refused."""
    from PIL import Image

    if image.mode.startswith("I;16"):
        grey = image.convert("F").resize((image_size, image_size), Image.Resampling.BILINEAR)
        return np.repeat((np.asarray(grey, dtype=np.float32) / np.float32(65535))[None], 3, axis=0)
    if image.mode in ("I", "F"):
        raise PrecsearchError(f"image {file} has 32-bit {'integer' if image.mode == 'I' else 'float'} pixels (mode "
                              f"{image.mode}), whose range precsearch cannot know; save it as an 8- or 16-bit image")
    rgb = image.convert("RGB").resize((image_size, image_size), Image.Resampling.BILINEAR)
    return np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / np.float32(255)


def _image_classes(split_dir: Path) -> list[str]:
    """Sorted names of the class folders under split_dir that hold at least one image."""
    return sorted(d.name for d in split_dir.iterdir()
                  if d.is_dir() and any(p.suffix.lower() in IMAGE_SUFFIXES for p in d.iterdir()))


def _load_image_folder(root: str | os.PathLike[str] | None, image_size: int) -> tuple[ImageDataset, ImageDataset]:
    expected = "train/<class>/*.png and val/<class>/*.png"
    path = _require_directory(root, "imagefolder", expected)
    for split in ("train", "val"):
        if not (path / split).is_dir():
            raise PrecsearchError(f"{path} has no {split}/ folder; expected the layout {expected}")
    classes = _image_classes(path / "train")
    if not classes:
        raise PrecsearchError(f"{path / 'train'} has no class folders holding images "
                              f"({', '.join(IMAGE_SUFFIXES)}); expected {expected}")
    val_classes = _image_classes(path / "val")
    unknown = sorted(set(val_classes) - set(classes))
    if unknown:
        raise PrecsearchError(f"{path / 'val'} has classes {', '.join(unknown)} that train/ lacks; "
                              "give every val class a train folder")
    # A class without val images is never scored: the accuracy would silently measure the other classes only.
    unscored = [name for name in classes if name not in val_classes]
    if unscored:
        raise PrecsearchError(f"{path / 'val'} holds no images of class {', '.join(unscored)}; give every train "
                              f"class val images ({expected})")
    train_files, val_files = _image_files(path / "train", classes), _image_files(path / "val", classes)
    _check_fits(sum(map(len, train_files + val_files)), image_size)
    train_images, train_labels = _read_image_folder(train_files, image_size)
    val_images, val_labels = _read_image_folder(val_files, image_size)
    return _normalized_pair(torch.from_numpy(train_images), torch.from_numpy(train_labels),
                            torch.from_numpy(val_images), torch.from_numpy(val_labels), classes)


def _load_synthetic(image_size: int, seed: int, num_classes: int, train_size: int,
                    val_size: int) -> tuple[ImageDataset, ImageDataset]:
    """Gaussian noise plus a fixed random pattern per class: seeded, and learnable for smoke training."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(num_classes, 3, image_size, image_size, generator=generator)

    def draw(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, num_classes, (count,), generator=generator)
        noise = torch.randn(count, 3, image_size, image_size, generator=generator)
        return noise + patterns[labels], labels

    train_images, train_labels = draw(train_size)
    val_images, val_labels = draw(val_size)
    classes = [str(i) for i in range(num_classes)]
    return _normalized_pair(train_images, train_labels, val_images, val_labels, classes)


GRATINGS_CONTRAST = 0.1  # the default difficulty knob of `gratings`; see _load_gratings
GRATINGS_LEVEL = 6.0  # the bright background every gratings image sits on


def _load_gratings(image_size: int, seed: int, contrast: float, train_size: int,
                   val_size: int) -> tuple[ImageDataset, ImageDataset]:
    """Faint oriented gratings on a bright background, not mean-subtracted: a task where low precision hurts.

    Class c is a sinusoidal grating of one of 5 orientations and 2 frequencies, with a random phase per
    image, of amplitude ``contrast`` plus pixel noise of a quarter of that, on a constant level of 6 (the
    images are left as they are, like raw pixel values fed without normalization). In a 16-bit float
    (9 mantissa bits: a step of 1/128 at 6) the grating spans about 25 steps and batch norm removes the
    level, so full precision learns the task; in an 8-bit float with 3 mantissa bits (a step of 1/2 at 6,
    and at the first convolution's outputs of the same size) the grating is rounded away where the input's
    first activations are low. ``contrast`` is the difficulty knob: the smaller, the more of the low-precision
    assignments fail.
    """
    if not 0 < contrast <= 1:
        raise PrecsearchError(f"contrast={contrast!r} must lie in (0, 1], e.g. {GRATINGS_CONTRAST}")
    generator = torch.Generator().manual_seed(seed)
    coords = torch.arange(image_size, dtype=torch.float32) / image_size
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")
    angles = torch.arange(5, dtype=torch.float32) * math.pi / 5
    frequencies = torch.tensor([2.0, 4.0])

    def draw(count: int) -> ImageDataset:
        labels = torch.randint(0, 10, (count,), generator=generator)
        angle, frequency = angles[labels % 5], frequencies[labels // 5]
        phase = 2 * math.pi * torch.rand(count, generator=generator)
        along = xs * torch.cos(angle)[:, None, None] + ys * torch.sin(angle)[:, None, None]
        grating = torch.sin(2 * math.pi * frequency[:, None, None] * along + phase[:, None, None])
        noise = 0.25 * contrast * torch.randn(count, 3, image_size, image_size, generator=generator)
        images = GRATINGS_LEVEL + contrast * grating[:, None] + noise
        return ImageDataset(images.contiguous(), labels, classes, torch.zeros(3), torch.ones(3))

    classes = [f"angle{i % 5 * 36}_freq{2 if i < 5 else 4}" for i in range(10)]
    return draw(train_size), draw(val_size)


def _positive_int(value: Any, what: str) -> int:
    """`value` if it is a positive int (not a bool), else a one-line error naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PrecsearchError(f"{what}={value!r} must be a positive integer")
    return value


def _fraction(value: float | None) -> float:
    """The digits validation share: 0.2 unless given, strictly between 0 and 1."""
    fraction = 0.2 if value is None else value
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction < 1:
        raise PrecsearchError(f"val_fraction={value!r} must lie strictly between 0 and 1, e.g. 0.2")
    return float(fraction)


def load_dataset(name: str = "digits", root: str | os.PathLike[str] | None = None, image_size: int = 32, *,
                 seed: int = 0, val_fraction: float | None = None, num_classes: int | None = None,
                 train_size: int | None = None, val_size: int | None = None, contrast: float | None = None
                 ) -> tuple[ImageDataset, ImageDataset]:
    """Train and validation datasets by name; see the module docstring for the names. `root` is the data folder
    (cifar10, cifar100, imagefolder only). `seed` fixes the digits split and the synthetic draw. `val_fraction` (digits,
    default 0.2) is the stratified validation share. `num_classes`, `train_size`, `val_size` (synthetic only; defaults
    10, 1024, 256) size the synthetic data. `gratings` takes `train_size`, `val_size` (defaults 2048, 1024) and
    `contrast` (its difficulty knob).
    """
    if name not in DATASETS:
        raise PrecsearchError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    image_size = _positive_int(image_size, "image_size")
    synthetic_options = {"num_classes": num_classes, "train_size": train_size, "val_size": val_size}
    misplaced = [key for key, value in synthetic_options.items()
                 if value is not None and name != "synthetic" and not (name == "gratings" and key != "num_classes")]
    if contrast is not None and name != "gratings":
        misplaced.append("contrast")
    if val_fraction is not None and name != "digits":
        misplaced.append("val_fraction")
    if root is not None and name in ("digits", "synthetic", "gratings"):
        misplaced.append("root")
    if misplaced:
        raise PrecsearchError(f"option(s) {', '.join(misplaced)} do not apply to dataset {name}; drop them")
    if name == "digits":
        train, val = _load_digits(image_size, seed, _fraction(val_fraction))
    elif name in _CIFAR_LAYOUT:
        train, val = _load_cifar(name, root, image_size)
    elif name == "imagefolder":
        train, val = _load_image_folder(root, image_size)
    else:  # drawn at the image size: their sizes are checked before the draw
        default_sizes = (2048, 1024) if name == "gratings" else (1024, 256)
        sizes = {"train_size": _positive_int(default_sizes[0] if train_size is None else train_size, "train_size"),
                 "val_size": _positive_int(default_sizes[1] if val_size is None else val_size, "val_size")}
        _check_fits(sum(sizes.values()), image_size)
        if name == "gratings":
            train, val = _load_gratings(image_size, seed, GRATINGS_CONTRAST if contrast is None else float(contrast),
                                        **sizes)
        else:
            train, val = _load_synthetic(image_size, seed, _positive_int(10 if num_classes is None else num_classes,
                                                                         "num_classes"), **sizes)
    log.info("dataset %s: %d train / %d val images of %s, %d classes", name, len(train), len(val),
             train.image_shape, train.num_classes)
    return train, val


def random_crop_flip(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                     generator: torch.Generator) -> torch.Tensor:
    """The reference recipe's augmentation on a batch of normalized images (N, C, H, W): each image padded by
    H // 8 pixels of black (0 before normalization, so ``-mean / std`` here; torchvision's RandomCrop(32,
    padding=4) at 32x32), cropped back to H x W at a random offset, and flipped left-right with probability
    1/2. Offsets and flips are drawn from ``generator`` (CPU), so a seed fixes them."""
    n, channels, height, width = images.shape
    pad = height // 8
    fill = (-mean / std).to(images.dtype).view(1, channels, 1, 1)
    padded = fill.expand(n, channels, height + 2 * pad, width + 2 * pad).clone()
    padded[:, :, pad:pad + height, pad:pad + width] = images
    top = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    left = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    rows = (top[:, None] + torch.arange(height))[:, :, None]  # (N, H, 1)
    cols = left[:, None] + torch.arange(width)  # (N, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)[:, None, :]  # (N, 1, W)
    batch = torch.arange(n)[:, None, None]
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2).contiguous()


def make_loader(dataset: Dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                drop_last: bool = False) -> DataLoader:
    """A single-process DataLoader whose shuffling is drawn from `torch.Generator().manual_seed(seed)`: the same
    seed gives the same batch order in every run, independent of torch's global RNG."""
    batch_size = _positive_int(batch_size, "batch_size")
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                      generator=generator, num_workers=0)
