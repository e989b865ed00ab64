"""torch.autocast as a baseline (issue 67): the trainer's autocast mode trains the plain model, the baselines table
records its measured peak (below plain fp32's, counted here with the allocator's events) and writes no policy file
for it, fp16 autocast is skipped off CUDA, and fp16's GradScaler counts the steps it skips."""

from __future__ import annotations

import logging
import math

import pandas as pd
import pytest
import torch

from precsearch.config.spaces import paper_space
from precsearch.config.spec import ProxyConfig
from precsearch.cost.measured import sgd_step, trace_step
from precsearch.models import build
from precsearch.search.baselines import run_baselines
from precsearch.train.autocast import CountingGradScaler
from precsearch.train.data import load_dataset
from precsearch.train.proxy import run_proxy

IMAGE, BATCH = 8, 64
CONFIG = ProxyConfig(batch_size=BATCH, image_size=IMAGE, eval_batch_size=256, bn_images=256)


def test_the_autocast_bf16_proxy_trains_under_autocast():
    """Its loss falls over 40 steps, and it is not plain fp32's run: the same seed under autocast rounds otherwise."""
    data = load_dataset("digits", image_size=IMAGE)
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        casted = run_proxy("tiny_cnn", None, data, 40, seed=0, device="cpu", config=CONFIG, autocast=torch.bfloat16)
        plain = run_proxy("tiny_cnn", None, data, 40, seed=0, device="cpu", config=CONFIG)
    curve = casted.loss_curve
    assert not casted.diverged and len(curve) == 40
    assert sum(curve[-5:]) / 5 < 0.5 * sum(curve[:5]) / 5
    assert curve != plain.loss_curve


@pytest.fixture(scope="module")
def autocast_table(tmp_path_factory):
    """baselines.csv of a run naming both autocast baselines on the CPU, and the INFO lines it logged."""
    out = tmp_path_factory.mktemp("autocast")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("precsearch.search.baselines")
    logger.addHandler(handler)
    before = logger.level
    logger.setLevel(logging.INFO)
    try:
        run_baselines("tiny_cnn", paper_space(), "digits", out_dir=out, proxy_steps=20, device="cpu",
                      names=["autocast_bf16", "autocast_fp16"], batch_size=BATCH, image_size=IMAGE, threads=1,
                      progress=False)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
    return out, pd.read_csv(out / "baselines.csv"), records


def _plain_fp32_peak() -> int:
    """One proxy step of plain fp32 tiny_cnn at the table's batch, its peak counted by the allocator's events."""
    torch.manual_seed(0)
    model = build("tiny_cnn")
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG.lr, momentum=CONFIG.momentum,
                                weight_decay=CONFIG.weight_decay)
    step = sgd_step(model, optimizer, torch.randn(BATCH, 3, IMAGE, IMAGE), torch.randint(0, 10, (BATCH,)))
    step()
    step()
    return trace_step(step).peak


def test_baselines_write_the_autocast_row_with_a_measured_peak_below_plain_fp32s(autocast_table):
    out, table, _ = autocast_table
    torch_rows = table[table["source"] == "torch"]
    assert torch_rows["name"].tolist() == ["autocast_bf16"]
    row = torch_rows.iloc[0]
    assert 0 < row["peak_bytes"] < _plain_fp32_peak()
    assert row["step_time"] > 0 and not row["diverged"] and row["val_accuracy"] > 0.5
    assert math.isnan(row["memory"]) and pd.isna(row["policy"])  # no formats assigned, no policy file
    assert not list((out / "baselines").glob("torch_*"))
    assert table.loc[table["source"] == "paper", "peak_bytes"].isna().all()  # the policy rows' meaning unchanged


def test_autocast_fp16_is_skipped_off_cuda_with_one_info_line(autocast_table):
    _, table, records = autocast_table
    assert "autocast_fp16" not in table["name"].tolist()
    assert [record.getMessage() for record in records if "autocast_fp16" in record.getMessage()] == [
        "autocast_fp16 skipped: torch.autocast(float16) with a GradScaler is CUDA's recipe, and this run is on the "
        "CPU"]


def test_the_grad_scaler_counts_the_step_it_skipped():
    """An inf in the input makes the weight's gradient non-finite: the step is skipped (weights kept, the scale
    halved from 2^16) and counted; a clean step after it is not."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = CountingGradScaler("cpu")
    before = model.weight.detach().clone()

    def step(x: torch.Tensor) -> None:
        scaler.scale(model(x).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    step(torch.tensor([[math.inf, 1.0, 1.0, 1.0]]))
    assert scaler.skipped_steps == 1 and torch.equal(model.weight, before) and scaler.get_scale() == 2.0**15
    step(torch.ones(1, 4))
    assert scaler.skipped_steps == 1 and not torch.equal(model.weight, before)
