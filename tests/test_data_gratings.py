"""The generated gratings task: seeded, sized, and built so that 8-bit floats lose its class signal."""

from __future__ import annotations

import pytest
import torch

from precsearch.errors import PrecsearchError
from precsearch.train.data import GRATINGS_LEVEL, load_dataset


def test_gratings_are_seeded_sized_and_balanced_enough():
    train, val = load_dataset("gratings", image_size=16, train_size=300, val_size=50, seed=3)
    again, _ = load_dataset("gratings", image_size=16, train_size=300, val_size=50, seed=3)
    other, _ = load_dataset("gratings", image_size=16, train_size=300, val_size=50, seed=4)
    assert train.images.shape == (300, 3, 16, 16) and len(val) == 50 and train.num_classes == 10
    assert torch.equal(train.images, again.images) and not torch.equal(train.images, other.images)
    assert set(train.labels.tolist()) == set(range(10))


def test_the_class_signal_lives_below_an_8_bit_step():
    """torch's own casts are the oracle: float8_e4m3fn (3 mantissa bits, a step of 1/2 at the level 6) rounds
    every pixel to the level, float16 keeps the grating to within 1/256."""
    train, _ = load_dataset("gratings", image_size=16, train_size=64, val_size=1, contrast=0.1)
    images = train.images
    assert (images - GRATINGS_LEVEL).abs().max() < 0.25  # grating + noise stay under half an e4m3 step
    assert torch.unique(images.to(torch.float8_e4m3fn).float()).tolist() == [GRATINGS_LEVEL]
    assert (images.to(torch.float16).float() - images).abs().max() <= 2**-8
    assert (images - GRATINGS_LEVEL).std() > 0.05  # ... while the grating itself is there


def test_gratings_options_are_checked():
    with pytest.raises(PrecsearchError, match="contrast"):
        load_dataset("gratings", contrast=2.0)
    with pytest.raises(PrecsearchError, match="contrast"):
        load_dataset("digits", contrast=0.1)
