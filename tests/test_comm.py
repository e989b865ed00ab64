"""AdaComp as a DDP hook, checked in two real gloo processes against a plain reference of the paper's rule.

One pair of processes (spawned once for the module) runs every distributed scenario and hands back what each
rank saw; the tests compare that with ``reference_layer``, written here element by element in numpy without
anything from precsearch.train.data_parallel.
"""

from __future__ import annotations

import csv
import logging
import math
import pickle
import socket
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from precsearch.cli import main
from precsearch.config.policy import Policy
from precsearch.errors import PrecsearchError
from precsearch.formats.kernels import quantize
from precsearch.models import build
from precsearch.train.data import load_dataset
from precsearch.train.data_parallel import AdaCompState, register_adacomp, train_data_parallel

BINS = {"conv": 4, "fc": 7, "other": 3}
# Probe's parameters in order, with the layer type each one's bin length follows.
PARAMS = [("conv.weight", "conv"), ("fc.weight", "fc"), ("fc.bias", "fc"), ("bn.weight", "other"),
          ("bn.bias", "other")]
HANDMADE_STEPS = 3  # dyadic gradients, then one step of normal floats, then one with an inf on rank 0
STEPS = HANDMADE_STEPS + 2


class Probe(nn.Module):
    """A conv, a Linear with bias and a BatchNorm whose loss is sum(param * target): each gradient is its target."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, bias=False)
        self.fc = nn.Linear(8, 3)
        self.bn = nn.BatchNorm2d(2)

    def forward(self, targets: list[torch.Tensor]) -> torch.Tensor:
        return sum((param * target).sum() for param, target in zip(self.parameters(), targets, strict=True))


def gradients(rank: int, step: int) -> list[torch.Tensor]:
    """Rank ``rank``'s hand-made gradients at ``step`` (1-based), one per Probe parameter."""
    shapes = [param.shape for param in Probe().parameters()]
    generator = torch.Generator().manual_seed(100 * rank + step)
    if step <= HANDMADE_STEPS:  # quarters in [-2, 2]: exact sums, many ties |H| == g_max
        grads = [torch.randint(-8, 9, shape, generator=generator).float() / 4 for shape in shapes]
        if step == 1:
            grads[0].view(-1)[4:8] = 0.0  # an all-zero bin: nothing may be sent from it
        return grads
    grads = [torch.randn(shape, generator=generator) for shape in shapes]
    if step == HANDMADE_STEPS + 2 and rank == 0:
        grads[1].view(-1)[5] = math.inf  # a loss-scale overflow on one rank
    return grads


def reference_layer(grad: np.ndarray, residual: np.ndarray, bin_length: int) -> tuple[np.ndarray, float, np.ndarray]:
    """The paper's rule for one layer, element by element: (values sent, scale, residual after the step)."""
    g = residual + grad
    h = g + grad
    maxima = [float(np.abs(g[start:start + bin_length]).max()) for start in range(0, g.size, bin_length)]
    scale = np.float32(math.fsum(maxima) / len(maxima))
    sent = np.zeros_like(g)
    for i in range(g.size):
        if g[i] != 0 and abs(h[i]) >= maxima[i // bin_length]:
            sent[i] = scale if g[i] > 0 else -scale
    return sent, float(scale), g - sent


# A rank that waits this long for its peer fails its test instead of holding the run for gloo's default 30 min.
GROUP_TIMEOUT = timedelta(seconds=120)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def probe_ddp(**options) -> tuple[DistributedDataParallel, AdaCompState]:
    model = DistributedDataParallel(Probe())
    state = register_adacomp(model, conv_bin=BINS["conv"], fc_bin=BINS["fc"], other_bin=BINS["other"], **options)
    return model, state


def backward(model: nn.Module, grads: list[torch.Tensor]) -> list[np.ndarray]:
    model.zero_grad(set_to_none=True)
    model(grads).backward()
    return [param.grad.detach().flatten().numpy().copy() for param in model.parameters()]


def scenarios(rank: int, world: int, port: int, folder: Path) -> None:
    """Everything the tests look at, run in one of two gloo processes."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    try:
        seen: dict = {"grads": [], "residuals": [], "sent_bytes": []}
        model, state = probe_ddp()
        params = list(model.parameters())
        for step in range(1, STEPS + 1):
            seen["grads"].append(backward(model, gradients(rank, step)))
            seen["residuals"].append([state.residuals[param].numpy().copy() for param in params])
            seen["sent_bytes"].append(state.compression()["sent_bytes"].tolist())
        seen["table"] = state.compression()
        state.reset_stats()
        seen["after_reset"] = (len(state.compression()), state.wire_bytes, len(state.residuals))

        alone, _ = probe_ddp()  # rank 1 sends nothing: the gradient is rank 0's message over 2
        zeros = [torch.zeros_like(grad) for grad in gradients(0, 1)]
        seen["alone"] = backward(alone, gradients(0, 1) if rank == 0 else zeros)

        plain = DistributedDataParallel(Probe())
        disabled, _ = probe_ddp(enabled=False)
        seen["plain"] = backward(plain, gradients(rank, HANDMADE_STEPS + 1))
        seen["disabled"] = backward(disabled, gradients(rank, HANDMADE_STEPS + 1))

        low, low_state = probe_ddp(residual_format="e5m2")
        backward(low, gradients(rank, HANDMADE_STEPS + 1))
        seen["low_residual"] = low_state.residuals[next(low.parameters())].numpy().copy()

        torch.manual_seed(0)
        net = DistributedDataParallel(build("tiny_cnn"), bucket_cap_mb=0.005)
        net_state = register_adacomp(net)
        images = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            net.zero_grad()
            nn.functional.cross_entropy(net(images), torch.arange(8)).backward()
        seen["net_grads"] = [param.grad.numpy().copy() for param in net.parameters()]
        seen["net_table"] = net_state.compression()
        (folder / f"rank{rank}.pickle").write_bytes(pickle.dumps(seen))
        dist.barrier()  # neither rank tears gloo down while the other still uses it
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("ranks")
    torch.multiprocessing.start_processes(scenarios, args=(2, free_port(), folder), nprocs=2, start_method="spawn")
    return [pickle.loads((folder / f"rank{rank}.pickle").read_bytes()) for rank in range(2)]


def reference_run() -> tuple[list, list]:
    """Per step: the averaged gradient every rank should hold, and each rank's residuals and sent bytes."""
    residuals = [[np.zeros(grad.numel(), np.float32) for grad in gradients(0, 1)] for _ in range(2)]
    averaged, per_rank = [], []
    for step in range(1, STEPS + 1):
        sent_by_rank = []
        for rank in range(2):
            sent_here = []
            for i, ((_, kind), grad) in enumerate(zip(PARAMS, gradients(rank, step), strict=True)):
                grad = grad.flatten().numpy()
                if not np.isfinite(grad).all():  # nothing sent but a NaN scale; the residual waits
                    sent_here.append(np.full_like(grad, np.nan))
                    continue
                sent, _, residuals[rank][i] = reference_layer(grad, residuals[rank][i], BINS[kind])
                sent_here.append(sent)
            sent_by_rank.append(sent_here)
        averaged.append([(a + b) / np.float32(2) for a, b in zip(*sent_by_rank, strict=True)])
        per_rank.append(([list(r) for r in residuals], [[int(np.count_nonzero(s)) for s in sent]
                                                        for sent in sent_by_rank]))
    return averaged, per_rank


def test_hook_equals_the_reference_rule_bit_for_bit(ranks):
    averaged, per_rank = reference_run()
    sent_bytes = [[0] * len(PARAMS) for _ in range(2)]
    for step in range(STEPS):
        residuals, counts = per_rank[step]
        for rank in range(2):
            for got, want in zip(ranks[rank]["grads"][step], averaged[step], strict=True):
                np.testing.assert_array_equal(got, want)  # NaN == NaN for the overflowed layer
            for got, want in zip(ranks[rank]["residuals"][step], residuals[rank], strict=True):
                assert got.tobytes() == want.tobytes()
            for i, count in enumerate(counts[rank]):
                finite = bool(torch.isfinite(gradients(rank, step + 1)[i]).all())
                sent_bytes[rank][i] += 8 + 4 * (count if finite else 0)
            assert ranks[rank]["sent_bytes"][step] == sent_bytes[rank]


def test_selected_elements_ternary_values_and_scale(ranks):
    for rank in range(2):
        got = ranks[rank]["alone"]
        for (_, kind), grad, values in zip(PARAMS, gradients(0, 1), got, strict=True):
            grad = grad.flatten().numpy()
            sent, scale, _ = reference_layer(grad, np.zeros_like(grad), BINS[kind])
            chosen = np.flatnonzero(sent)
            assert chosen.size and np.array_equal(np.flatnonzero(values), chosen)
            assert np.array_equal(values[chosen], np.where(grad[chosen] > 0, scale, -scale) / 2)
    conv = gradients(0, 1)[0].flatten().numpy()
    assert not conv[4:8].any() and not ranks[0]["alone"][0][4:8].any()  # the zero bin sends nothing


def test_every_rank_ends_with_the_same_gradients(ranks):
    for step in range(STEPS):
        for a, b in zip(ranks[0]["grads"][step], ranks[1]["grads"][step], strict=True):
            assert a.tobytes() == b.tobytes()
    for a, b in zip(ranks[0]["net_grads"], ranks[1]["net_grads"], strict=True):
        assert a.tobytes() == b.tobytes()
    assert all(grad.any() for grad in ranks[0]["net_grads"])


def test_disabled_compression_is_plain_all_reduce(ranks):
    for rank in range(2):
        for got, want in zip(ranks[rank]["disabled"], ranks[rank]["plain"], strict=True):
            assert got.tobytes() == want.tobytes()


def test_residual_is_held_in_the_chosen_format(ranks):
    grad = gradients(0, HANDMADE_STEPS + 1)[0].flatten().numpy()
    _, _, residual = reference_layer(grad, np.zeros_like(grad), BINS["conv"])
    want = quantize(torch.from_numpy(residual), "e5m2", overflow="saturate").numpy()
    assert ranks[0]["low_residual"].tobytes() == want.tobytes()
    assert not np.array_equal(want, residual)


def test_compression_table_names_layers_and_counts_bytes(ranks):
    table = ranks[0]["table"]
    assert list(table.columns) == ["name", "layer_type", "dense_bytes", "sent_bytes", "ratio"]
    assert list(zip(table["name"], table["layer_type"], strict=True)) == PARAMS
    numels = [grad.numel() for grad in gradients(0, 1)]
    assert table["dense_bytes"].tolist() == [4 * n * STEPS for n in numels]
    assert np.allclose(table["ratio"], table["dense_bytes"] / table["sent_bytes"])
    assert ranks[0]["after_reset"] == (0, 0, len(PARAMS))  # counts cleared, residuals kept
    net = ranks[0]["net_table"].set_index("name")
    assert [name for name, _ in build("tiny_cnn").named_parameters()] == list(net.index)
    assert net.loc["conv1.weight", "layer_type"] == "conv"
    assert net.loc["linear.weight", "layer_type"] == "fc"
    assert net.loc["bn1.weight", "layer_type"] == "other"


@pytest.mark.parametrize("options", [{"conv_bin": 0}, {"fc_bin": -3}, {"other_bin": 2.5}, {"conv_bin": True}])
def test_bin_length_below_one_is_a_clear_error(options):
    with pytest.raises(PrecsearchError, match=f"{next(iter(options))}=.*bin length must be an integer >= 1"):
        AdaCompState(**options)


def test_other_bad_inputs_are_clear_errors():
    with pytest.raises(PrecsearchError, match="format 'e99m2'"):
        AdaCompState(residual_format="e99m2")
    with pytest.raises(PrecsearchError, match="the model is a Linear; wrap it in .*DistributedDataParallel"):
        register_adacomp(nn.Linear(2, 2))
    data = load_dataset("synthetic", image_size=8)
    with pytest.raises(PrecsearchError, match="nproc=0"):
        train_data_parallel("tiny_cnn", None, data, 1, nproc=0)
    with pytest.raises(PrecsearchError, match="compress='zip'"):
        train_data_parallel("tiny_cnn", None, data, 1, compress="zip")
    with pytest.raises(PrecsearchError, match=r"made for inputs \(3, 16, 16\), the data has \(3, 8, 8\)"):
        train_data_parallel("tiny_cnn", Policy(model="tiny_cnn", input_shape=(3, 16, 16)), data, 1)
    with pytest.raises(PrecsearchError, match="compression: 'zip' is not allowed"):
        Policy(compression="zip")


def test_one_process_warns_once_and_passes_gradients_through(caplog, tmp_path):
    # a file store: no TCP server thread in the test process itself
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1,
                            timeout=GROUP_TIMEOUT)
    try:
        model, state = probe_ddp()
        with caplog.at_level(logging.WARNING, logger="precsearch.train.data_parallel"):
            for step in (1, 2):
                got = backward(model, gradients(0, step))
                for g, want in zip(got, gradients(0, step), strict=True):
                    assert np.array_equal(g, want.flatten().numpy())
        assert [r.getMessage() for r in caplog.records].count(
            "AdaComp: the process group has one process, so there is nothing to compress; "
            "gradients pass through uncompressed") == 1
        assert state.residuals == {} and state.compression().empty
    finally:
        dist.destroy_process_group()


def test_policy_carries_the_compression_setting(tmp_path):
    plain = Policy(model="tiny_cnn")
    assert "compression" not in plain.to_dict()  # files without it read as before
    path = Policy(model="tiny_cnn", compression="adacomp").save(tmp_path / "p.json")
    assert Policy.load(path).compression == "adacomp"


def test_cli_trains_in_two_processes_with_adacomp(tmp_path, capsys):
    metrics = tmp_path / "m.csv"
    code = main(["train", "tiny_cnn", "--nproc", "2", "--compress", "adacomp", "--steps", "4", "--eval-every", "2",
                 "--metrics", str(metrics), "--device", "cpu", "--threads", "1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "trained in 2 processes (adacomp): 4 steps" in out and "compression (dense / sent bytes): conv" in out
    assert [row["step"] for row in csv.DictReader(metrics.open())] == ["2", "4"]
    table = list(csv.DictReader((tmp_path / "m.compression.csv").open()))
    assert {row["name"] for row in table} == {name for name, _ in build("tiny_cnn").named_parameters()}
    assert all(float(row["ratio"]) > 1 for row in table)


def test_cli_rejects_compression_without_processes(capsys):
    assert main(["train", "tiny_cnn", "--steps", "1", "--compress", "adacomp"]) == 2
    assert "--compress adacomp needs --nproc N" in capsys.readouterr().err
