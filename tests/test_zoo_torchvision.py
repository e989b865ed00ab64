"""torchvision's zoo (when torchvision imports; it is no precsearch dependency): saved bytes predicted within 2%
of autograd's in fp32 and of the runtime's under the hfp8 and fp16 baselines, and swin_t's attention listed
as not enforced. The same check as benchmarks/zoo_check.py, at small images."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from precsearch.analysis.checks import TOLERANCE, check_model

pytest.importorskip("torchvision")

_spec = importlib.util.spec_from_file_location("zoo_check", Path(__file__).resolve().parents[1] / "benchmarks"
                                               / "zoo_check.py")
zoo_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zoo_check)

IMAGE = 96  # inception_v3 needs 75 or more; swin_t's windows pad smaller stages


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo_check.MODELS)
def test_zoo_model_saved_bytes_within_two_percent(name):
    batch = torch.randn((3, 3, IMAGE, IMAGE), generator=torch.Generator().manual_seed(1))
    result = check_model(zoo_check.build(name), batch, name=name)
    assert abs(result.fp32_error) <= TOLERANCE, result.summary()
    for policy in ("hfp8", "fp16"):
        assert abs(result.ratio(policy) - 1) <= TOLERANCE, result.summary()
    if name == "swin_t":
        assert result.unenforced and all(op.startswith("shifted_window_attention") for op in result.unenforced)
    else:
        assert not result.unenforced, result.summary()
