"""AdaComp (Chen et al., AAAI 2018): adaptive residual gradient compression as a DDP communication hook.

Use it like torch's PowerSGD hook::

    state = AdaCompState(process_group=None, conv_bin=50, fc_bin=500, model=ddp_model)
    ddp_model.register_comm_hook(state, adacomp_hook)        # or: state = register_adacomp(ddp_model)
    ...
    state.compression()                                      # bytes and ratio per parameter since reset_stats()

The rule, per parameter tensor ("layer") and step, with ``dW`` this rank's gradient and ``R`` its residual:

1. ``G = R + dW`` and ``H = G + dW`` (H leans towards elements whose gradient keeps growing in one direction);
2. ``G`` is cut into bins of ``L`` consecutive elements (the flattened gradient; the last bin may be short),
   ``L`` = ``conv_bin`` for convolutions, ``fc_bin`` for Linear layers, ``other_bin`` for the rest (BatchNorm);
3. in each bin, ``g_max`` = max ``|G|``; an element is sent when ``|H| >= g_max`` (and ``G != 0``);
4. a sent element is ternary: ``sign(G) * scale``, one ``scale`` per layer = the mean of ``g_max`` over the
   layer's bins (computed in float64, rounded once to float32);
5. ``R = G - sent``: what was not sent, and the quantization error of what was, waits for later steps.

Where this comes from: the paper's full text was not reachable from this project, so the rule follows its
Algorithm 1 as we know it (G, H, per-bin g_max, |H| >= g_max, residue = G - Gq) and an independent open
implementation of it (MXNet's contrib ``ada_comp`` operator), which takes the scale to be the mean of the
bins' g_max, as here. Our one addition: an element with ``G == 0`` is never sent (its ternary value is 0, so
sending it carries nothing; it also keeps an all-zero bin, whose g_max is 0, from selecting every element).

Exchange: each rank sends, per layer, its count of sent elements, its scale (float32 bits) and the sent
elements' indices with the sign folded in (``+-(index + 1)`` as int32): 8 + 4k bytes for k elements, the
figure ``sent_bytes`` reports against the ``dense_bytes`` of the gradient itself. Payload lengths differ
between ranks, so the sizes are all-gathered first, then the payloads padded to the longest (``wire_bytes``
counts the sizes and the padding too). Every rank decodes every payload in rank order and averages, so every
rank ends with the same gradient, bit for bit. Both collectives block inside the hook: started from future
callbacks instead, they could interleave with another bucket's differently on different ranks (gloo then
aborts on mismatched message sizes), so this hook trades overlap with backward for a fixed order.

The residual is kept in ``residual_format`` (fp32 by default, or any precsearch.formats.format format, nearest
rounding, saturating) and in units of the unscaled loss: a training loop with a loss scaler sets
``state.loss_scale`` before each backward. A non-finite local gradient (a loss-scale overflow) is sent as
a NaN scale so that every rank's gradient is non-finite and every scaler skips the step; the residual is
left as it was.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import contextlib
import itertools
import logging
import math
import os
import pickle
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from precsearch.config.policy import Policy
from precsearch.config.spec import COMPRESSIONS, ProxyConfig
from precsearch.errors import PrecsearchError
from precsearch.files import atomic_write_text
from precsearch.formats.format import get_format
from precsearch.formats.kernels import quantize
from precsearch.runtime.model import apply_policy
from precsearch.runtime.scaling import NoLossScaler
from precsearch.train.data import ImageDataset, make_loader
from precsearch.train.reading import read_model
from precsearch.train.trainer import (
    METRICS_COLUMNS,
    build_model,
    check_policy_inputs,
    eval_interval,
    metrics_row,
    resolve_device,
)

__all__ = ["LAYER_TYPES", "AdaCompState", "DataParallelResult", "adacomp_hook", "compression_by_type", "layer_type",
           "register_adacomp", "train_data_parallel"]

log = logging.getLogger(__name__)

LAYER_TYPES: tuple[str, ...] = ("conv", "fc", "other")
_HEADER_BYTES = 8  # per layer: the count of sent elements and the scale, int32 + float32
_INDEX_BYTES = 4  # per sent element: its index with the sign folded in, int32


def layer_type(module: nn.Module) -> str:
    """``conv`` for any convolution, ``fc`` for Linear, ``other`` for the rest: picks the paper's bin length."""
    return "conv" if isinstance(module, nn.modules.conv._ConvNd) else "fc" if isinstance(module, nn.Linear) else "other"


def _bin_length(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PrecsearchError(f"{name}={value!r}: a bin length must be an integer >= 1 "
                              "(the paper uses 50 for convolutions and 500 for fully connected layers)")
    return value


def _innermost(model: nn.Module) -> nn.Module:
    """The user's model inside DDP and precsearch wrappers (both keep it as ``.module``), for its names."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


@dataclass
class _Layer:
    name: str
    kind: str
    dense_bytes: int = 0
    sent_bytes: int = 0


class AdaCompState:
    """AdaComp's settings, per-parameter residuals and byte counts; pass it to ``register_comm_hook``.

    ``model`` (the DDP model, or the model inside it) names the parameters and gives each its module's layer
    type; without it, parameters are named ``param0, param1, ...`` in the order DDP first hands them over and
    typed by shape (>= 3 dims conv, 2 dims fc, else other). ``enabled=False`` makes the hook a plain
    all-reduce. The hook runs in whatever process group ``process_group`` is (default: the whole world).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, conv_bin: int = 50, fc_bin: int = 500,
                 other_bin: int = 50, residual_format: str = "fp32", *, model: nn.Module | None = None,
                 enabled: bool = True) -> None:
        self.process_group = process_group
        self.bins = {"conv": _bin_length(conv_bin, "conv_bin"), "fc": _bin_length(fc_bin, "fc_bin"),
                     "other": _bin_length(other_bin, "other_bin")}
        self.residual_format = get_format(residual_format)
        self.enabled, self.loss_scale, self.step, self.wire_bytes = bool(enabled), 1.0, 0, 0
        self.residuals: dict[nn.Parameter, torch.Tensor] = {}
        self._layers: dict[nn.Parameter, _Layer] = {}
        if model is not None:
            for module_name, module in _innermost(model).named_modules():
                for param_name, param in module.named_parameters(prefix=module_name, recurse=False):
                    self._layers[param] = _Layer(param_name, layer_type(module))
        self._step_bytes = {kind: [0, 0] for kind in LAYER_TYPES}
        self._warned = False

    def _layer(self, param: nn.Parameter) -> _Layer:
        """The name, layer type and byte counts of ``param`` (named and typed on first sight)."""
        if param not in self._layers:
            kind = "conv" if param.dim() >= 3 else "fc" if param.dim() == 2 else "other"
            self._layers[param] = _Layer(f"param{len(self._layers)}", kind)
        return self._layers[param]

    def compression(self) -> Any:
        """A pandas DataFrame, one row per parameter that was compressed since ``reset_stats``: ``name``,
        ``layer_type``, ``dense_bytes`` (the gradient a plain all-reduce sends), ``sent_bytes``, ``ratio``."""
        import pandas as pd

        rows = [{"name": layer.name, "layer_type": layer.kind, "dense_bytes": layer.dense_bytes,
                 "sent_bytes": layer.sent_bytes} for layer in self._layers.values() if layer.dense_bytes]
        frame = pd.DataFrame(rows, columns=["name", "layer_type", "dense_bytes", "sent_bytes"])
        frame["ratio"] = frame["dense_bytes"] / frame["sent_bytes"]
        return frame

    def reset_stats(self) -> None:
        """Zero every byte count (residuals are kept)."""
        for layer in self._layers.values():
            layer.dense_bytes = layer.sent_bytes = 0
        self.wire_bytes = 0

    def _count(self, layer: _Layer, dense: int, sent: int) -> None:
        layer.dense_bytes += dense
        layer.sent_bytes += sent
        self._step_bytes[layer.kind][0] += dense
        self._step_bytes[layer.kind][1] += sent

    def _end_step(self) -> None:
        """Log the step's ratio per layer type (DDP hands over the bucket that ``is_last`` at the end)."""
        self.step += 1
        figures = [f"{kind} {dense / sent:.1f}x" for kind, (dense, sent) in self._step_bytes.items() if sent]
        log.info("adacomp step %d: dense / sent bytes %s", self.step, ", ".join(figures))
        self._step_bytes = {kind: [0, 0] for kind in LAYER_TYPES}


def _compress(grad: torch.Tensor, residual: torch.Tensor, bin_length: int, loss_scale: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's step of the rule: (signed indices +-(i + 1) int32, scale float32 (1,), G - sent)."""
    g = residual * loss_scale + grad
    h = g + grad
    n = g.numel()
    bins = -(-n // bin_length)
    g_max = F.pad(g.abs(), (0, bins * bin_length - n)).view(bins, bin_length).amax(dim=1)
    selected = (h.abs() >= g_max.repeat_interleave(bin_length)[:n]) & (g != 0)
    scale = g_max.double().mean().float().reshape(1)
    index = selected.nonzero().flatten()
    positive = g[index] > 0
    sent = torch.zeros_like(g)
    sent[index] = torch.where(positive, scale, -scale)
    signed = torch.where(positive, index + 1, -(index + 1)).to(torch.int32)
    return signed, scale, g - sent


def adacomp_hook(state: AdaCompState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: AdaComp-compress each parameter of the bucket, exchange, average."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if world == 1 and not state._warned:
        log.warning("AdaComp: the process group has one process, so there is nothing to compress; "
                    "gradients pass through uncompressed")
        state._warned = True
    if world == 1 or not state.enabled:
        if bucket.is_last():
            state.step += 1
        return allreduce_hook(group, bucket)
    buffer = bucket.buffer()
    params, grads = bucket.parameters(), bucket.gradients()
    counts, scales, indices = [], [], []
    for param, grad in zip(params, grads, strict=True):
        layer = state._layer(param)
        grad = grad.detach().flatten().float()
        residual = state.residuals.get(param)
        residual = torch.zeros_like(grad) if residual is None else residual
        if torch.isfinite(grad).all():
            signed, scale, left = _compress(grad, residual, state.bins[layer.kind], state.loss_scale)
            state.residuals[param] = quantize(left / state.loss_scale, state.residual_format, overflow="saturate")
        else:
            signed, scale = grad.new_zeros(0, dtype=torch.int32), grad.new_full((1,), math.nan)
        counts.append(signed.numel())
        scales.append(scale)
        indices.append(signed)
        state._count(layer, grad.numel() * buffer.element_size(), _HEADER_BYTES + _INDEX_BYTES * signed.numel())
    header = torch.tensor(counts, dtype=torch.int32, device=buffer.device)
    payload = torch.cat([header, torch.cat(scales).view(torch.int32), *indices])
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=buffer.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    padded = F.pad(payload, (0, int(torch.cat(sizes).max()) - payload.numel()))
    received = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(received, padded, group=group)
    state.wire_bytes += size.element_size() + padded.numel() * padded.element_size()
    buffer.copy_(_decode(received, [grad.numel() for grad in grads], buffer.device).div_(world))
    if bucket.is_last():
        state._end_step()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


def _decode(payloads: list[torch.Tensor], numels: list[int], device: torch.device) -> torch.Tensor:
    """Sum of every rank's ternary gradient over the bucket, added in rank order (the same on every rank)."""
    layers = len(numels)
    offsets = torch.tensor([0, *numels[:-1]], dtype=torch.int64, device=device).cumsum(0)
    total = torch.zeros(sum(numels), dtype=torch.float32, device=device)
    for payload in payloads:
        counts = payload[:layers].long()
        scales = payload[layers:2 * layers].view(torch.float32)
        signed = payload[2 * layers:2 * layers + int(counts.sum())].long()
        owner = torch.repeat_interleave(torch.arange(layers, device=device), counts)
        values = torch.where(signed > 0, scales[owner], -scales[owner])
        total.index_put_((offsets[owner] + signed.abs() - 1,), values, accumulate=True)
        for layer in (~torch.isfinite(scales)).nonzero().flatten().tolist():
            total[offsets[layer]:offsets[layer] + numels[layer]] += scales[layer]
    return total


def compression_by_type(table: Any) -> Any:
    """A ``compression()`` table summed per layer type, plus a row ``all``: dense_bytes, sent_bytes, ratio."""
    totals = table.groupby("layer_type")[["dense_bytes", "sent_bytes"]].sum()
    totals.loc["all"] = totals.sum()
    totals["ratio"] = totals["dense_bytes"] / totals["sent_bytes"]
    return totals


def register_adacomp(model: nn.Module, **options: Any) -> AdaCompState:
    """Register the AdaComp hook on a ``DistributedDataParallel`` model; ``options`` go to ``AdaCompState``."""
    if not isinstance(model, DistributedDataParallel):
        raise PrecsearchError(f"AdaComp compresses DistributedDataParallel's gradient exchange, but the model is "
                              f"a {type(model).__name__}; wrap it in torch.nn.parallel.DistributedDataParallel")
    state = AdaCompState(model=model, **options)
    model.register_comm_hook(state, adacomp_hook)
    return state


# --------------------------------------------------------------------------- data-parallel training


@dataclass
class DataParallelResult:
    """What ``train_data_parallel`` measured (rank 0's model; all ranks hold the same weights)."""

    val_accuracy: float
    val_loss: float
    steps_run: int
    loss_curve: list[float]
    wall_time: float
    nproc: int
    compress: str
    compression: Any = None  # AdaCompState.compression() summed over ranks, or None without compression
    wire_bytes: int = 0  # bytes all ranks put on the wire for AdaComp, sizes and padding included
    skipped_steps: int = 0


@dataclass(frozen=True)
class _Job:
    model_spec: str
    policy: Policy | None
    data: tuple[ImageDataset, ImageDataset]
    steps: int
    seed: int
    device: str
    config: ProxyConfig
    compress: str
    comm_options: dict[str, Any]
    eval_every: int | None
    metrics: str | None
    threads: int
    log_level: int


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _shard(dataset: ImageDataset, rank: int, world: int) -> ImageDataset:
    """Every ``world``-th image from ``rank`` on: disjoint shards, as DistributedSampler without shuffling."""
    return ImageDataset(dataset.images[rank::world], dataset.labels[rank::world], dataset.classes,
                        dataset.mean, dataset.std)


def _epochs(dataset: ImageDataset, batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless seeded epochs of a shard, reshuffled with seed + epoch."""
    for epoch in itertools.count():
        yield from make_loader(dataset, batch_size, shuffle=True, seed=seed + epoch, drop_last=True)


def train_data_parallel(model_spec: str, policy: Policy | None, data: tuple[ImageDataset, ImageDataset], steps: int,
                        nproc: int = 2, compress: str | None = None, seed: int = 0, device: str = "cpu",
                        config: ProxyConfig | None = None, *, comm_options: dict[str, Any] | None = None,
                        eval_every: int | None = None, metrics: str | Path | None = None, threads: int | None = None
                        ) -> DataParallelResult:
    """Train ``model_spec`` (under ``policy``, or plain fp32) in ``nproc`` DDP processes on this machine.

    The proxy recipe (``config``: SGD, momentum, weight decay, cosine schedule) with ``config.batch_size`` as
    the global batch, split evenly over the processes (rounded down), each on its own shard of the training
    set. Gradients are exchanged by plain all-reduce (``compress="none"``) or AdaComp (``comm_options`` go to
    ``AdaCompState``). gloo on CPU, nccl on CUDA (one GPU per process); rank 0 evaluates every
    ``eval_every`` steps and at the end, and writes the ``metrics`` CSV (the columns of
    ``train.train_policy``) and, with AdaComp, the per-parameter compression table beside it
    (``<metrics stem>.compression.csv``).
    """
    config = config or ProxyConfig()
    if compress is None:
        compress = policy.compression if policy is not None else "none"
    if compress not in COMPRESSIONS:
        raise PrecsearchError(f"compress={compress!r}: use one of {', '.join(COMPRESSIONS)}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise PrecsearchError(f"nproc={nproc!r}: the number of processes must be an integer >= 1")
    if steps < 1:
        raise PrecsearchError(f"steps={steps} must be at least 1")
    eval_interval(eval_every, 1)  # refused here, not in the processes
    if config.batch_size < nproc:
        raise PrecsearchError(f"batch size {config.batch_size} is smaller than {nproc} processes; "
                              "raise the batch size or lower --nproc")
    check_policy_inputs(policy, data[0])
    if len(data[0]) < config.batch_size:
        raise PrecsearchError(f"the training set has {len(data[0])} images, too few for a batch of "
                              f"{config.batch_size}; lower the batch size or give more data")
    torch_device = resolve_device(device)
    if torch_device.type == "cuda" and torch.cuda.device_count() < nproc:
        raise PrecsearchError(f"--nproc {nproc} needs one GPU per process, this machine has "
                              f"{torch.cuda.device_count()}; lower --nproc or use --device cpu")
    AdaCompState(**(comm_options or {}))  # bad options fail here, in one line, not in every process
    job = _Job(model_spec, policy, data, steps, seed, torch_device.type, config, compress,
               dict(comm_options or {}), eval_every, None if metrics is None else str(metrics),
               threads or max(1, (os.cpu_count() or 1) // nproc), logging.getLogger().getEffectiveLevel())
    with tempfile.TemporaryDirectory(prefix="precsearch-ddp-") as folder:
        report = Path(folder) / "result.pickle"  # a file, not a queue: a pipe could fill up before join()
        torch.multiprocessing.start_processes(_worker, args=(nproc, _free_port(), job, report), nprocs=nproc,
                                              start_method="spawn")
        return pickle.loads(report.read_bytes())


def _worker(rank: int, world: int, port: int, job: _Job, report: Path) -> None:
    """One process of ``train_data_parallel``: join the group, train its shard, rank 0 reports."""
    logging.basicConfig(level=job.log_level, format=f"[rank {rank}] %(message)s")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(job.threads)
    cuda = job.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        result = _train_rank(rank, world, device, job)
        if rank == 0:
            report.write_bytes(pickle.dumps(result))
        dist.barrier()  # no rank tears gloo down while another still uses it (that aborted 1 run in 4)
    finally:
        dist.destroy_process_group()


def _train_rank(rank: int, world: int, device: torch.device, job: _Job) -> DataParallelResult | None:
    config, train_set = job.config, job.data[0]
    torch.manual_seed(job.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model(job.model_spec, train_set.num_classes, train_set.images[:2]).to(device)
    start = time.perf_counter()  # training time: a user factory's own is not counted
    if job.policy is not None:
        model = apply_policy(model, job.policy, seed=job.seed, stats_every=config.stats_every,
                             steps_per_epoch=len(train_set) // config.batch_size)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    state = register_adacomp(ddp, **job.comm_options) if job.compress == "adacomp" else None
    sgd = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    optimizer = model.wrap_optimizer(sgd) if job.policy is not None else sgd
    scaler = model.scaler if job.policy is not None else NoLossScaler()
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=job.steps)
    per_epoch = max(1, len(train_set) // config.batch_size)
    eval_every = eval_interval(job.eval_every, per_epoch)
    rows = [METRICS_COLUMNS]
    curve: list[float] = []
    batches = _epochs(_shard(train_set, rank, world), config.batch_size // world, job.seed + 1000 * rank)
    for step in range(1, job.steps + 1):
        images, labels = (tensor.to(device) for tensor in next(batches))
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(images), labels)
        if state is not None:
            state.loss_scale = float(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        schedule.step()
        curve.append(float(loss.detach()))
        if rank == 0 and (step % eval_every == 0 or step == job.steps):
            reading = read_model(model, job.data, device, bn_images=config.bn_images,
                                 eval_batch_size=config.eval_batch_size, seed=job.seed)
            accuracy, val_loss = reading.accuracy, reading.loss
            rows.append(metrics_row(step, per_epoch, curve[-eval_every:], reading, time.perf_counter() - start))
            if job.metrics is not None:
                atomic_write_text(job.metrics, "\n".join(rows) + "\n")
    compression, wire = _gather_compression(state, device)
    if rank != 0:
        return None
    if compression is not None and job.metrics is not None:
        atomic_write_text(Path(job.metrics).with_suffix(".compression.csv"), compression.to_csv(index=False))
    return DataParallelResult(accuracy, val_loss, job.steps, curve, time.perf_counter() - start, world,
                              job.compress, compression, wire, scaler.skipped_steps)


def _gather_compression(state: AdaCompState | None, device: torch.device) -> tuple[Any, int]:
    """The compression table with bytes summed over all ranks (each rank sends its own selection)."""
    if state is None:
        return None, 0
    table = state.compression()
    counts = torch.tensor([*table["dense_bytes"], *table["sent_bytes"], state.wire_bytes], dtype=torch.float64,
                          device=device)
    dist.all_reduce(counts)
    rows = len(table)
    table["dense_bytes"] = counts[:rows].long().tolist()
    table["sent_bytes"] = counts[rows:2 * rows].long().tolist()
    table["ratio"] = table["dense_bytes"] / table["sent_bytes"]
    return table, int(counts[-1])
