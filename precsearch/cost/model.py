"""Memory of a precision assignment, from a TensorGraph, and autograd's saved bytes, predicted and measured.

Two countings of activation memory, which differ and are both reported:
- the paper's (`activation_bytes`): every op's output is an activation tensor, priced at numel x bits / 8.
- autograd's (`saved_activation_bytes`): only what backward needs (conv its input, ReLU its output, add/cat/
  flatten nothing, max-pool its input plus int64 indices, an in-place ReLU6 a clone of its input, ...), each
  storage once, at the whole bytes of its format's storage dtype. What each op saves is recorded while tracing
  (`precsearch.graph.tracing.trace`, saved_tensors_hooks); the op rules' `saves` are only the fallback for graphs
  traced with module hooks. `measure_saved_bytes` measures the same on a real forward.
- a saved storage's format, the runtime packer's rule: a saved activation is stored at the format of the tensor
  whose value was saved, the last rounding of that storage (an in-place ReLU after a high BN at the ReLU's
  format); a storage autograd or an op made itself (a clone, BN statistics, masks, indices, values inside a leaf
  function) is never rounded and stays at its dtype.
For ResNet-18 the paper's counting is larger, because BN outputs and residual sums are never saved.

Weight-update memory (fp32 masters, Kahan buffers, optimizer state) depends on the training configuration:
`update_bytes` and `breakdown(..., optimizer=...)` price it with `precsearch.runtime.optim`'s own per-parameter rule,
so the cost model and the optimizer cannot disagree. Without an optimizer, every trainable parameter keeps an
fp32 master copy and an fp32 SGD momentum (the graph's `master_weight` and `optimizer_state` tensors).

Scaled formats (`e4m3fn@tensor`, precsearch.formats.scaled) are priced as their element's codes plus their
scales, one e8m0 byte per tensor, row or block (`ScaledFormat.scales_shape`), wherever a value of the tensor is
held: the paper's counting also holds a delayed recipe's amax history (float32 per entry, state the runtime
keeps for the whole run: `scale_bytes`), autograd's saved bytes and a step's blocks only the scales beside the
codes (what the runtime packs). The runtime keeps a scaled weight's codes and scales from its layer's forward to
its backward rather than round the master again (a rounding of a slice would take another amax).

The peak of a training step (`peak_bytes`, `peak_timeline`) is a third measure: what one forward, backward
and optimizer step holds at once above parameters and optimizer state, predicted by replaying the step on
the graph (precsearch.cost.measured measures it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from precsearch.config.optimizer import UpdateConfig
from precsearch.config.spec import ASSIGNABLE_KINDS, KINDS, PAPER_HIGH, PAPER_LOW
from precsearch.errors import PrecsearchError
from precsearch.formats import kernels
from precsearch.formats.format import FloatFormat, get_format
from precsearch.formats.scaled import ScaledFormat, any_format, scale_bytes
from precsearch.graph.in_place import gradient_arrives_fresh, gradient_passes_from, makes_fresh_output
from precsearch.graph.op_rules import ASSUMED_SAVES
from precsearch.graph.runs import forward_error, training_mode
from precsearch.graph.types import OpInfo, TensorGraph, grad_id
from precsearch.runtime.optim import update_bytes_per_param
from precsearch.runtime.sites import SitePlan, plan_sites

if TYPE_CHECKING:
    import pandas as pd

    from precsearch.config.policy import Policy

log = logging.getLogger(__name__)

MIB = 2**20
FP32 = get_format("fp32")
Spec = str | FloatFormat | ScaledFormat


@dataclass(frozen=True)
class Held:
    """One block of a predicted step timeline: `nbytes` live from `start` to `end` inclusive. Times: forward
    of op i is 2i, backward of op i is 4n - 2i (n ops), a weight gradient's rounding 0.5 after its layer's
    backward, optimizer 4n + 3."""

    nbytes: int
    start: float
    end: float
    what: str


@dataclass(frozen=True)
class SavedTensor:
    """One storage autograd keeps for backward, as predicted: an activation (`tensor` is the id whose value is
    saved, stored at its assigned format; `key` the activation owning the storage) or a storage the op made
    (`tensor` None: stored at its own `itemsize`)."""

    key: str
    tensor: str | None
    numel: int
    itemsize: int | None
    saved_by: tuple[str, ...]


def _storage_bytes(fmt: FloatFormat) -> int:
    """Bytes per element when a tensor is stored packed in `fmt`: 4 for fp32, else the storage dtype's."""
    return fmt.storage_bytes


def _held_scales(fmt: FloatFormat | ScaledFormat, shape: tuple[int, ...]) -> int:
    """Bytes a scaled format holds beside a tensor's codes, amax history included (`scale_bytes`); 0 unscaled."""
    return scale_bytes(fmt, shape) if isinstance(fmt, ScaledFormat) else 0


def _element(fmt: FloatFormat | ScaledFormat) -> FloatFormat:
    """The format of one value: a scaled format's element."""
    return fmt.element if isinstance(fmt, ScaledFormat) else fmt


def _stored_scales(fmt: FloatFormat | ScaledFormat | None, shape: tuple[int, ...]) -> int:
    """Bytes of the scales stored beside a tensor's codes (one e8m0 byte each; 0 for an unscaled format)."""
    return math.prod(fmt.scales_shape(shape)) if isinstance(fmt, ScaledFormat) else 0


class CostModel:
    """Prices assignments of one TensorGraph. `high` and `low` (per assignable kind) are the two formats a
    group decision chooses between (`bytes_batch`, `group_assignment`); they default to the paper's. What each
    op saves, and its workspaces, come from the op rules the graph was traced with (`graph.rules`)."""

    def __init__(self, graph: TensorGraph, high: Spec = PAPER_HIGH, low: Mapping[str, Spec] | None = None) -> None:
        self.graph = graph
        self.high = get_format(high)
        low = dict(PAPER_LOW if low is None else low)
        missing = [kind for kind in ASSIGNABLE_KINDS if kind not in low]
        extra = sorted(set(low) - set(ASSIGNABLE_KINDS))
        if missing or extra:
            raise PrecsearchError(f"low formats must name exactly the kinds {', '.join(ASSIGNABLE_KINDS)}; "
                                  f"missing {missing or 'none'}, unknown {extra or 'none'}")
        self.low = {kind: any_format(spec) for kind, spec in low.items()}
        self.ids = list(graph.tensors)
        infos = list(graph.tensors.values())
        self._numel = np.array([info.numel for info in infos], dtype=np.float64)
        self._kind = np.array([KINDS.index(info.kind) for info in infos])
        self._index = {tid: i for i, tid in enumerate(self.ids)}
        self._assignable = np.isin(self._kind, [KINDS.index(k) for k in ASSIGNABLE_KINDS])
        groups = np.array([info.group for info in infos])
        self.n_groups = len(graph.groups)
        high_bits = np.where(self._assignable, self.high.bits, 0) * self._numel
        low = [self.low.get(info.kind) for info in infos]
        low_bits = np.array([0 if fmt is None else _element(fmt).bits * info.numel + 8 * _held_scales(fmt, info.shape)
                             for fmt, info in zip(low, infos, strict=True)])
        # (n_groups, 2) table: bits of each group's assignable tensors when held high / low.
        self.group_bits = np.zeros((self.n_groups, 2))
        np.add.at(self.group_bits[:, 0], groups, high_bits)
        np.add.at(self.group_bits[:, 1], groups, low_bits)
        self._all_high_bits = self.group_bits[:, 0].sum()
        self._low_minus_high = self.group_bits[:, 1] - self.group_bits[:, 0]
        self._group_numel = np.zeros(self.n_groups)
        np.add.at(self._group_numel, groups, np.where(self._assignable, self._numel, 0))
        self._group_of = groups
        # ids of the trainable weights (those the graph gives a master copy), the ones an optimizer updates
        self._trainable = [tid for tid, info in graph.tensors.items()
                           if info.kind == "weight" and f"{tid}_master" in graph.tensors]
        self.saved = _predict_saved(graph)
        self._fresh_gradients = gradient_arrives_fresh(graph)  # outputs whose gradient is rounded over itself
        by_name = {op.name: op for op in graph.ops}  # and those that are so where an add's is rounded alike:
        self._gradient_sources = {name: by_name[add] for name, add in gradient_passes_from(graph).items()}

    # ------------------------------------------------------------------------------------------ memory

    def _formats(self, assignment: Mapping[str, Spec] | None) -> dict[str, FloatFormat]:
        """Tensor id -> the format of one of its values (a scaled format's element: `_scaled` has the rest)."""
        return {tid: _element(fmt) for tid, fmt in self._resolve(assignment).items()}

    def _scaled(self, assignment: Mapping[str, Spec] | None) -> dict[str, ScaledFormat]:
        """Tensor id -> scaled format, for the tensors `assignment` gives one."""
        return {tid: fmt for tid, fmt in self._resolve(assignment).items() if isinstance(fmt, ScaledFormat)}

    def _resolve(self, assignment: Mapping[str, Spec] | None) -> dict[str, FloatFormat | ScaledFormat]:
        formats = {}
        for tid, spec in (assignment or {}).items():
            info = self.graph.tensors.get(tid)
            if info is None:
                raise PrecsearchError(f"assignment names unknown tensor {tid!r}; use ids from the graph "
                                      f"(e.g. {self.ids[min(1, len(self.ids) - 1)]!r})")
            if info.kind not in ASSIGNABLE_KINDS:
                raise PrecsearchError(f"tensor {tid!r} is a {info.kind}, always fp32; assign only "
                                      f"{', '.join(ASSIGNABLE_KINDS)} tensors")
            formats[tid] = any_format(spec)
        return formats

    def _tensor_bits(self, assignment: Mapping[str, Spec] | None) -> np.ndarray:
        """Bits per tensor in graph order: numel x format bits (fp32 where unassigned), plus a scaled format's
        scales (and amax history)."""
        per_element = np.full(len(self.ids), 32.0)
        scales = np.zeros(len(self.ids))
        for tid, fmt in self._resolve(assignment).items():
            per_element[self._index[tid]] = _element(fmt).bits
            scales[self._index[tid]] = 8 * _held_scales(fmt, self.graph.tensors[tid].shape)
        return per_element * self._numel + scales

    def _mask(self, kinds: Iterable[str]) -> np.ndarray:
        kinds = list(kinds)
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            raise PrecsearchError(f"unknown tensor kind(s) {unknown}; choose from {', '.join(KINDS)}")
        return np.isin(self._kind, [KINDS.index(k) for k in kinds])

    def bits(self, assignment: Mapping[str, Spec] | None = None, kinds: Iterable[str] = ASSIGNABLE_KINDS) -> int:
        """Total bits of the tensors of `kinds` (default: the four assignable kinds) under `assignment`
        (tensor id -> format; unnamed tensors are fp32)."""
        return int(self._tensor_bits(assignment)[self._mask(kinds)].sum())

    def bytes(self, assignment: Mapping[str, Spec] | None = None, kinds: Iterable[str] = ASSIGNABLE_KINDS) -> float:
        """`bits(...) / 8`: the paper's counting, every tensor of `kinds` at numel x bits / 8."""
        return self.bits(assignment, kinds) / 8

    def activation_bytes(self, assignment: Mapping[str, Spec] | None = None) -> float:
        """The paper's activation memory: every op output (BN, ReLU, add, pool, cat included) at its format."""
        return self.bytes(assignment, kinds=("activation",))

    def breakdown(self, assignment: Mapping[str, Spec] | None = None, optimizer: str | None = None,
                  config: UpdateConfig | Mapping[str, Any] | None = None, momentum: bool = True,
                  amsgrad: bool = False) -> pd.DataFrame:
        """MiB by group (rows, plus a `total` row) and by kind (columns, plus a `total` column).

        Without `optimizer`, master weights and momentum are fp32. With it, the `master_weight`,
        `compensation` and `optimizer_state` columns are `update_bytes`'s under `config`, each weight at its
        format in `assignment` (unnamed: fp32), as the runtime hands the policy's formats to the optimizer."""
        import pandas as pd

        mib = self._tensor_bits(assignment) / 8 / MIB
        table = np.zeros((self.n_groups, len(KINDS)))
        np.add.at(table, (self._group_of, self._kind), mib)
        frame = pd.DataFrame(table, columns=list(KINDS), index=pd.RangeIndex(self.n_groups, name="group"))
        if optimizer is not None:
            per_tensor = self._update_table(optimizer, config, assignment or {}, momentum, amsgrad)
            groups = [self._group_of[self._index[tid]] for tid in self._trainable]
            frame.insert(frame.columns.get_loc("master_weight") + 1, "compensation", 0.0)
            for kind in ("master_weight", "compensation", "optimizer_state"):
                column = np.zeros(self.n_groups)
                np.add.at(column, groups, per_tensor[kind] / MIB)
                frame[kind] = column
        frame["total"] = frame.sum(axis=1)
        frame.loc["total"] = frame.sum(axis=0)
        return frame

    def update_bytes(self, optimizer: str = "sgd", config: UpdateConfig | Mapping[str, Any] | None = None,
                     weight_formats: Mapping[str, Spec] | None = None, momentum: bool = True,
                     amsgrad: bool = False) -> dict[str, float]:
        """Bytes of every trainable parameter's `weight`, fp32 `master_weight`, Kahan `compensation` buffer and
        `optimizer_state` (optim's `update_bytes_per_param` keys) when training with `optimizer` ("sgd", "adam",
        "adamw") under `config` (an `UpdateConfig` or a policy's optimizer dict). Each weight is in `config`'s
        weight_format or, with `weight_formats` (an assignment), in its format there, fp32 where unnamed, as
        `LowPrecisionOptimizer` treats a format mapping."""
        per_tensor = self._update_table(optimizer, config, weight_formats, momentum, amsgrad)
        return {kind: float(values.sum()) for kind, values in per_tensor.items()}

    def _update_table(self, optimizer: str, config: UpdateConfig | Mapping[str, Any] | None,
                      weight_formats: Mapping[str, Spec] | None, momentum: bool,
                      amsgrad: bool) -> dict[str, np.ndarray]:
        """Update kind -> bytes of each trainable parameter (in `_trainable` order), by optim's rule."""
        cfg = config if isinstance(config, UpdateConfig) else UpdateConfig.from_dict(config or {})
        default = get_format(cfg.weight_format)
        per_format = {default: update_bytes_per_param(optimizer, cfg, momentum, amsgrad)}  # validates all
        formats = None if weight_formats is None else self._formats(weight_formats)
        table = {kind: np.zeros(len(self._trainable)) for kind in per_format[default]}
        for row, tid in enumerate(self._trainable):
            fmt = default if formats is None else formats.get(tid, FP32)
            if fmt not in per_format:  # `replace` re-validates the config for this weight format
                per_format[fmt] = update_bytes_per_param(optimizer, replace(cfg, weight_format=str(fmt)),
                                                         momentum, amsgrad)
            for kind, size in per_format[fmt].items():
                table[kind][row] = size * self._numel[self._index[tid]]
        return table

    def low_share(self, assignment: Mapping[str, Spec]) -> float:
        """Share of the assignable tensors' elements held in fewer bits than the high format. (The paper's
        ratio over group decisions, which also counts weight grads whose low format equals the high one, is
        `ratio_batch`.)"""
        formats = self._formats(assignment)
        low = [tid in formats and formats[tid].bits < self.high.bits for tid in self.ids]
        return float(low_share(np.where(self._assignable, self._numel, 0), low))

    # ------------------------------------------------------------------------------ step peak

    def peak_bytes(self, assignment: Mapping[str, Spec] | None = None, slices: Mapping[str, int] | None = None) -> int:
        """Predicted peak of one training step (forward, backward, optimizer) above the parameters and
        optimizer state, under `assignment` as `precsearch.runtime` trains it, eagerly or through its compiled
        step, which holds what the eager step holds (see `peak_timeline`); `slices` as `apply_policy`'s."""
        return _peak(self.peak_timeline(assignment, slices))[1]

    def finer_slices(self, assignment: Mapping[str, Spec] | None = None, most: int = 16) -> dict[str, int]:
        """Op name -> slices for the sliced backwards that set the step's peak (`apply_policy(..., slices=...)`):
        while the predicted peak is a sliced backward's, that layer's slices doubled (up to `most`), kept where
        the peak falls. Only the layers at the peak slice finer, so the step pays their smaller kernels alone."""
        slices: dict[str, int] = {}
        blocks = self.peak_timeline(assignment)
        while True:
            time, peak = _peak(blocks)
            n = len(self.graph.ops)
            backward = 2 * n < time <= 4 * n and time % 2 == 0  # the backward of an op (``_StepReplay.bwd``)
            op = self.graph.ops[int(4 * n - time) // 2] if backward else None
            if op is None or self.graph.rules.sliced_saved_tensor(op) is None or slices.get(op.name, 1) >= most:
                return slices
            trial = {**slices, op.name: 2 * slices.get(op.name, 1)}
            trial_blocks = self.peak_timeline(assignment, trial)
            if _peak(trial_blocks)[1] >= peak:
                return slices
            slices, blocks = trial, trial_blocks

    def peak_timeline(self, assignment: Mapping[str, Spec] | None = None,
                      slices: Mapping[str, int] | None = None) -> list[Held]:
        """Every block the step holds, replayed on the graph: saved tensors in their formats until the backward
        of their first saver; float32 forward values until their last forward use; activation gradients (float32)
        from the backward of their last consumer to that of their producer, as codes from their rounding on where
        the site plan hands them on so (``OpSites.gradient_codes``: an add's, held until the backward of the
        last input it reaches, and a sliced layer's, which that layer decodes a slice at a time; elsewhere
        whole); weight gradients (float32) from their op's backward to the optimizer; kernel workspaces. Where a
        tensor is low, the runtime's transients too: the raw float32 value beside its rounded copy (not where the
        rounding writes over the op's output: ``graph.makes_fresh_output``, not saved by its producer or saved as
        the rounding's codes), packed codes, the decoded float32 copy kept from the first to the last unpack, a
        rounded copy of each gradient (not where the rounding writes over it:
        ``graph.gradient_arrives_fresh``, the activation low too, or ``graph.gradient_passes_from``, the add's
        output gradient in the same format), a sliced backward's workspace (``OpRules.sliced_saved_tensor``), a
        float32 copy of each low weight during its layer's call (the whole forward under module hooks) and again
        in its layer's backward, which rounds the fp32 master again rather than keep the codes (a stochastically
        rounded weight keeps its codes between the two, which this model does not count; a scaled one keeps codes
        and scales, which it counts), a rounded copy of each low weight gradient as it arrives and, where its
        format fits 16 bits, its codes to the end of the backward (``.grad`` decoded then); the int32 a CPU kernel
        writes 16-bit codes in, or reads them in, for the moment of a gradient's rounding or a slice's decode. The
        optimizer holds one gradient-sized temporary (SGD's weight decay). The input batch is not counted unless
        packed."""
        step = _StepReplay(self.graph, self._formats(assignment), self._scaled(assignment),
                           plan_sites(self.graph, per_use=False, slices=slices))
        saved_fp32, reads_kept = self._hold_saved(step, assignment)
        self._hold_values_and_gradients(step, saved_fp32)
        channel_sliced = _hold_workspaces(step, reads_kept)
        self._hold_weights(step, channel_sliced)
        return step.blocks

    def _hold_saved(self, step: _StepReplay, assignment: Mapping[str, Spec] | None) -> tuple[set[str], set[int]]:
        """Saved tensors' blocks (codes and their decoded copies where low); returns the activations saved in
        float32 (their forward value is that block) and the sliced backwards that read a kept decoded copy."""
        ops = step.graph.ops
        saved_fp32: set[str] = set()
        reads_kept: set[int] = set()
        for entry, size in zip(self.saved, self._saved_bytes(assignment), strict=True):
            savers = sorted(step.index[name] for name in entry.saved_by)
            if entry.tensor is None:
                step.hold(size, step.fwd(savers[0]), step.bwd(savers[0]), f"saved {entry.key}")
            elif step.format(entry.tensor).is_fp32:
                owner = step.root[entry.tensor]  # an in-place op's output lives in its input's storage
                if ops[step.producer[owner]].role != "input":
                    saved_fp32.add(owner)
                    step.hold(size, step.fwd(step.producer[owner]), step.bwd(savers[0]), f"saved {entry.tensor}")
            else:
                step.hold(size, step.fwd(savers[0]), step.bwd(savers[0]), f"codes {entry.tensor}")
                whole = [i for i in savers if step.sliced.get(i) != entry.tensor]
                if whole:  # decoded at the first backward that unpacks it whole, kept to the last unpack
                    step.hold(4 * entry.numel, step.bwd(whole[-1]), step.bwd(savers[0]), f"decoded {entry.tensor}")
                    # a sliced backward after that one reads the kept copy: it decodes nothing
                    reads_kept.update(i for i in savers if step.sliced.get(i) == entry.tensor and i < whole[-1])
        return saved_fp32, reads_kept

    def _hold_values_and_gradients(self, step: _StepReplay, saved_fp32: set[str]) -> None:
        """Each activation's float32 forward value (and its unrounded copy where low), its gradient and the
        gradient's rounded copy."""
        graph, ops, rules = step.graph, step.graph.ops, step.graph.rules
        # outputs their producer saved: the runtime rounds the others of a fresh-output op over the op's output
        self_saved = {entry.tensor for entry in self.saved if entry.tensor is not None
                      and entry.tensor in step.producer and ops[step.producer[entry.tensor]].name in entry.saved_by}
        for tid, i in step.producer.items():
            numel = graph.tensors[tid].numel
            if ops[i].role != "input" and step.root[tid] == tid:
                if tid not in saved_fp32:
                    step.hold(4 * numel, step.fwd(i), step.fwd(step.last_use.get(tid, i)), f"float32 {tid}")
                in_place = makes_fresh_output(ops[i], rules) and (tid not in self_saved or step.format(tid).packs)
                if not step.format(tid).is_fp32 and not in_place:
                    step.hold(4 * numel, step.fwd(i), step.fwd(i), f"unrounded {tid}")
            if step.needs_grad[tid]:
                users = [step.index[name] for name in graph.tensors[tid].consumers if name in step.index]
                add = self._passes_alike(step, tid)
                grad_format = step.format(grad_id(tid))
                alike = add is not None
                arrives = step.bwd(max(users)) if users else 4.0 * step.n
                codes = step.gradient_codes(add.outputs[0] if alike else tid)  # what the op's backward reads
                if alike and self._holds_shared_gradient(step, tid, add):  # the add's gradient, as it came
                    step.hold(4 * numel if codes is None else codes, arrives, step.bwd(i), f"gradient {tid}")
                elif not alike and codes is not None:  # float32 to its rounding, then as codes
                    step.hold(4 * numel, arrives, step.bwd(i) - 1, f"gradient {tid}")
                    step.hold(codes, step.bwd(i) - 1, step.bwd(i), f"gradient codes {tid}")
                    step.hold(numel * _written_codes_bytes(grad_format), step.bwd(i) - 1, step.bwd(i) - 1,
                              f"gradient codes as written {tid}")
                elif not alike:
                    step.hold(4 * numel, arrives, step.bwd(i), f"gradient {tid}")
                if codes is not None and not rules.op_type(ops[i].module_type).passes_gradient:
                    step.hold(step.gradient_decode(i, tid), step.bwd(i), step.bwd(i), f"decoded gradient {tid}")
                for user in sorted(set(users))[:-1]:  # each later reader's part, made beside the sum so far
                    if not rules.op_type(ops[user].module_type).passes_gradient:
                        step.hold(4 * numel, step.bwd(user), step.bwd(user), f"gradient part {tid}")
                rounded_over = alike or (ops[i].name in self._fresh_gradients and not step.format(tid).is_fp32)
                if not grad_format.is_fp32 and not rounded_over:
                    step.hold(4 * numel, step.bwd(i) - 1, step.bwd(i) - 1, f"rounded gradient {tid}")

    def _passes_alike(self, step: _StepReplay, tid: str) -> OpInfo | None:
        """The add whose output gradient is ``tid``'s gradient itself, in the same format
        (``graph.gradient_passes_from``: rounding it again changes no value), or None."""
        add = self._gradient_sources.get(step.graph.ops[step.producer[tid]].name)
        if add is None or step.format(grad_id(add.outputs[0])) != step.format(grad_id(tid)):
            return None
        return add

    def _holds_shared_gradient(self, step: _StepReplay, tid: str, add: OpInfo) -> bool:
        """Whether ``tid``'s block holds the add's gradient, which the add hands each input as the same tensor:
        that tensor lives to the backward of the last input to read it. Where another input has a gradient block
        of its own (its gradient rounded into a new tensor, or read by other ops too), that block holds it; where
        every input passes it alike, the one whose backward comes last (the earliest producer) does."""
        sharing = [t for t in add.input_tensors if step.needs_grad[t]]
        if any(self._passes_alike(step, t) is None for t in sharing):
            return False
        return tid == min(sharing, key=lambda t: step.producer[t])

    def _hold_weights(self, step: _StepReplay, channel_sliced: set[str]) -> None:
        """Each trainable weight's gradient (held as codes where low and packed), its low copies, and the
        optimizer's temporary."""
        graph = step.graph
        low_weights = total = 0
        for tid in self._trainable:
            info = graph.tensors[tid]
            users = sorted(step.index[name] for name in info.consumers)
            total += 4 * info.numel
            grad_format = step.format(f"{tid}_grad")
            after = step.bwd(users[0]) + 0.5  # in the hook after the layer's backward, its workspace freed
            held = not grad_format.is_fp32 and grad_format.packs  # as codes to the end of the backward
            until = after if held else 4.0 * step.n + 3
            step.hold(4 * info.numel, step.bwd(users[-1]), until, f"weight gradient {tid}")
            if not grad_format.is_fp32:
                step.hold(4 * info.numel, after, after, f"rounded weight gradient {tid}")
            if held:
                codes = (info.numel * _storage_bytes(grad_format)
                         + _stored_scales(step.scaled.get(f"{tid}_grad"), info.shape))
                step.hold(codes, after, 4.0 * step.n, f"held weight gradient {tid}")
                step.hold(4 * info.numel, 4.0 * step.n, 4.0 * step.n + 3, f"decoded weight gradient {tid}")
            fmt = step.format(tid)
            if tid in step.scaled:  # its codes and scales, from its layer's forward to its backward
                codes = info.numel * _storage_bytes(fmt) + _stored_scales(step.scaled[tid], info.shape)
                step.hold(codes, step.fwd(users[0]), step.bwd(users[-1]), f"codes {tid}")
            if not fmt.is_fp32:
                low_weights += 4 * info.numel
                if tid not in channel_sliced:  # rounded again from the master in its layer's backward
                    step.hold(4 * info.numel, step.bwd(users[-1]), step.bwd(users[-1]), f"re-rounded {tid}")
                if step.traced:  # rounded at the layer's call: its float32 copy dies with the call
                    for user in users:
                        step.hold(4 * info.numel, step.fwd(user), step.fwd(user), f"rounded {tid}")
        if low_weights and not step.traced:  # module hooks: every weight rounded before the forward
            step.hold(low_weights, -1.0, step.fwd(step.n - 1), "rounded weights")
        step.hold(total, 4.0 * step.n + 3, 4.0 * step.n + 3, "optimizer temporary")

    # ---------------------------------------------------------------------------- group decisions

    def _decisions(self, decisions: Any) -> np.ndarray:
        matrix = np.asarray(decisions)
        matrix = matrix.reshape(1, -1) if matrix.ndim == 1 else matrix
        if matrix.ndim != 2 or matrix.shape[1] != self.n_groups:
            raise PrecsearchError(f"decisions must have shape (n, {self.n_groups}) (one column per group), "
                                  f"got {np.shape(decisions)}")
        return matrix.astype(np.float64, copy=False)

    def group_assignment(self, decisions: Any) -> dict[str, FloatFormat]:
        """The tensor -> format assignment of one row of group decisions (True = low) for every assignable
        tensor."""
        row = self._decisions(decisions)
        if row.shape[0] != 1:
            raise PrecsearchError(f"group_assignment takes one row of decisions, got {row.shape[0]}")
        low_groups = row[0].astype(bool)
        return {tid: (self.low[info.kind] if low_groups[info.group] else self.high)
                for tid, info in self.graph.tensors.items() if info.kind in ASSIGNABLE_KINDS}

    def bytes_batch(self, decisions: Any) -> np.ndarray:
        """Bytes of the assignable tensors for each row of an (n, n_groups) decision matrix (True = low): the
        product [1 - D, D] @ `group_bits`, computed as all-high bits + D @ (low - high) (exact in float64)."""
        low = self._decisions(decisions)
        return (self._all_high_bits + low @ self._low_minus_high) / 8

    def ratio_batch(self, decisions: Any) -> np.ndarray:
        """The paper's low-precision ratio per row: share of assignable elements in groups decided low."""
        return low_share(self._group_numel, self._decisions(decisions))

    # ------------------------------------------------------------------------- autograd saved bytes

    def saved_activation_bytes(self, assignment: Mapping[str, Spec] | None = None) -> int:
        """Bytes autograd keeps for backward, as predicted from the graph (see `_predict_saved`): every saved
        storage once, a saved activation at its format's storage bytes (4 for fp32, 1 for <= 8 bits, 2 for
        <= 16), byproducts at their own dtype. Parameters are weights and are not counted here."""
        return sum(self._saved_bytes(assignment))

    def _saved_bytes(self, assignment: Mapping[str, Spec] | None) -> list[int]:
        formats, scaled = self._formats(assignment), self._scaled(assignment)
        return [s.numel * (s.itemsize or _storage_bytes(formats.get(s.tensor, FP32)))
                + (_stored_scales(scaled.get(s.tensor), self.graph.tensors[s.tensor].shape) if s.tensor else 0)
                for s in self.saved]


def finer_slices(graph: TensorGraph, policy: Policy) -> dict[str, int]:
    """``CostModel(graph).finer_slices`` of ``policy``'s assignment: what ``apply_policy(..., slices=finer_slices)``
    and ``precsearch train --finer-slices`` run."""
    return CostModel(graph).finer_slices(policy.assignment(graph))


def _peak(blocks: list[Held]) -> tuple[float, int]:
    """The time of a timeline's peak (its first) and the bytes held then."""
    times = sorted({time for block in blocks for time in (block.start, block.end)})
    held = [(sum(b.nbytes for b in blocks if b.start <= time <= b.end), -time) for time in times]
    nbytes, time = max(held, default=(0, 0.0))
    return -time, nbytes


def low_share(numel: Any, low: Any) -> Any:
    """The paper's low-precision ratio, the one definition: the share of elements held low. ``numel`` is per
    tensor (or group) and ``low`` 0/1 over them, or a matrix with one row per candidate (one share each);
    0 when there are no elements. Sums of element counts are exact in float64."""
    numel = np.asarray(numel, dtype=np.float64)
    low = np.asarray(low, dtype=np.float64)
    total = numel.sum()
    return low @ numel / total if total else np.zeros(low.shape[:-1])


def _predict_saved(graph: TensorGraph) -> list[SavedTensor]:
    """What every op whose output needs a gradient saves (recorded while tracing, else the op rules' `saves`,
    `ASSUMED_SAVES` for an op they do not describe); one entry per storage."""
    requires_grad: dict[str, bool] = {}
    root: dict[str, str] = {}  # activation id -> activation owning its storage (in-place ops share it)
    entries: dict[str, SavedTensor] = {}
    unknown: set[str] = set()

    def save(key: str, tensor: str | None, numel: int, itemsize: int | None, op: str) -> None:
        entry = entries.get(key) or SavedTensor(key, tensor, numel, itemsize, ())
        entries[key] = replace(entry, saved_by=(*entry.saved_by, op))

    for op in graph.ops:
        trainable = any(f"{pid}_grad" in graph.tensors for pid in op.params)
        needs_grad = trainable or any(requires_grad.get(t, False) for t in op.input_tensors)
        for tid in op.outputs:
            requires_grad[tid] = needs_grad
            in_place = op.attrs.get("inplace") and op.input_tensors
            root[tid] = root[op.input_tensors[0]] if in_place else tid
        if op.role == "input" or not needs_grad:
            continue
        if "saves" in op.attrs:  # what autograd was seen to save while tracing (precsearch.graph.fx_trace)
            for index, (kind, what, *itemsize) in enumerate(op.attrs["saves"]):
                if kind == "activation":
                    save(root[what], what, graph.tensors[what].numel, None, op.name)
                else:
                    save(f"{op.name}:saved{index}", None, what, itemsize[0], op.name)
            continue
        rule = graph.rules.op_type(op.module_type).saves
        if rule is None:
            unknown.add(op.module_type)
            rule = ASSUMED_SAVES
        for item in rule:
            for saved in _rule_items(item, op, graph, trainable):
                if isinstance(saved, str):
                    save(root[saved], saved, graph.tensors[saved].numel, None, op.name)
                else:
                    save(f"{op.name}:{item}", None, *saved, op.name)
    if unknown:
        log.warning("no autograd save rule for op type(s) %s; assuming they save their inputs and output",
                    ", ".join(sorted(unknown)))
    return list(entries.values())


class _StepReplay:
    """A training step replayed on a graph under one assignment (``CostModel.peak_timeline``): when each op's
    forward and backward run, the forward's lifetimes, and the blocks held so far."""

    def __init__(self, graph: TensorGraph, formats: dict[str, FloatFormat], scaled: dict[str, ScaledFormat],
                 plan: SitePlan) -> None:
        self.graph, self.formats, self.scaled = graph, formats, scaled
        self.codes_ops = {sites.op for sites in plan.ops if sites.gradient_codes}  # ``OpSites.gradient_codes``
        self.at_least = {sites.op: sites.slices for sites in plan.ops if sites.slices > 1}  # ``OpSites.slices``
        self.n = len(graph.ops)
        self.index = {op.name: i for i, op in enumerate(graph.ops)}
        self.producer, self.root, self.needs_grad, self.last_use = _forward_lifetimes(graph)
        self.traced = graph.graph_module is not None
        self.sliced: dict[int, str] = {}  # op index -> the low tensor whose codes its backward reads in slices
        for i, op in enumerate(graph.ops):
            tid = graph.rules.sliced_saved_tensor(op) if self.traced else None
            if tid is not None and not self.format(tid).is_fp32:
                self.sliced[i] = tid
        self.blocks: list[Held] = []

    def fwd(self, i: int) -> float:
        return 2.0 * i

    def bwd(self, i: int) -> float:
        return 4.0 * self.n - 2.0 * i

    def format(self, tid: str) -> FloatFormat:
        return self.formats.get(tid, FP32)

    def gradient_codes(self, tid: str) -> int | None:
        """Bytes of the codes activation ``tid``'s rounded gradient travels as (the site plan's
        ``OpSites.gradient_codes``, a low format with codes: ``Slot.holds_codes``), or None where it travels
        float32."""
        fmt, scaled = self.format(grad_id(tid)), self.scaled.get(grad_id(tid))
        op = self.graph.ops[self.producer[tid]]
        if op.name not in self.codes_ops or (fmt.is_fp32 and scaled is None) or not fmt.packs:
            return None
        info = self.graph.tensors[tid]
        return info.numel * _storage_bytes(fmt) + _stored_scales(scaled, info.shape)

    def gradient_decode(self, i: int, tid: str) -> int:
        """Float32 bytes op ``i``'s backward decodes of its output ``tid``'s gradient codes: a slice of samples
        where it reads its saved tensor in several, else the whole gradient."""
        shape = self.graph.tensors[tid].shape
        if i in self.sliced:
            op = self.graph.ops[i]
            rows = self.graph.rules.sliced_rows(op, self.graph.tensors, self.at_least.get(op.name, 1))
            if rows < self.graph.tensors[self.sliced[i]].shape[0]:
                return 4 * rows * math.prod(shape[1:])
        return 4 * math.prod(shape)

    def hold(self, nbytes: float, start: float, end: float, what: str) -> None:
        self.blocks.append(Held(int(nbytes), start, end, what))


def _written_codes_bytes(fmt: FloatFormat) -> int:
    """Bytes per element of the wider codes a CPU kernel writes ``fmt``'s in before narrowing them, or reads them
    in after widening them (int32 for 16-bit codes, ``kernels.kernel_codes_dtype``), held for a moment beside
    the codes or the values; 0 where it takes them at their width."""
    kept = kernels.storage_dtype(fmt)
    written = kernels.kernel_codes_dtype(kept, torch.device("cpu"))
    return 0 if written == kept else written.itemsize


def _hold_workspaces(step: _StepReplay, reads_kept: set[int]) -> set[str]:
    """Kernel workspaces: oneDNN's forward, each backward's, and a sliced backward's slices; returns the
    weights whose conv's backward decodes them a channel slice at a time."""
    graph, rules = step.graph, step.graph.rules
    channel_sliced = set()
    for i, op in enumerate(graph.ops):
        inputs = 4 * sum(graph.tensors[tid].numel for tid in op.input_tensors)
        outputs = 4 * sum(graph.tensors[tid].numel for tid in op.outputs)
        rule = rules.op_type(op.module_type)
        grad_units = rule.input_gradient_workspace if any(step.needs_grad[tid] for tid in op.input_tensors) else 0
        kernel = (rule.backward_workspace + max(grad_units - 1, 0)) * inputs + (grad_units > 0) * max(inputs, outputs)
        if rule.forward_workspace:  # oneDNN's forward: the reordered input and weight beside the blocked
            # output, then that beside the output's plain copy (the output's own block)
            params = 4 * sum(graph.tensors[p].numel for p in op.params)
            step.hold(max(inputs + params, outputs), step.fwd(i), step.fwd(i), f"forward workspace {op.name}")
        if i in step.sliced:
            shape, slicing = graph.tensors[step.sliced[i]].shape, rule.sliced
            weight_info = max((graph.tensors[p] for p in op.params), key=lambda info: info.numel, default=None)
            sample, weight = math.prod(shape[1:]), 0 if weight_info is None else weight_info.numel
            at_least = step.at_least.get(op.name, 1)
            rows = rules.sliced_rows(op, graph.tensors, at_least)
            decodes = i not in reads_kept
            widened = decodes * _written_codes_bytes(step.format(step.sliced[i]))  # beside a slice as it decodes
            channels = (slicing.channels_per_group(shape, weight_info.shape, at_least) if slicing.channels is not None
                        else shape[1])
            if channels < shape[1]:  # one slice of samples in groups of input channels
                channel_sliced.add(weight_info.id)
                group_input = 4 * shape[0] * channels * math.prod(shape[2:])
                group_weight = 4 * weight * channels // shape[1]
                work = (slicing.channels.output_gradient * 4 * graph.tensors[op.outputs[0]].numel
                        + (slicing.channels.input - (not decodes)) * group_input
                        + slicing.channels.weight * group_weight)
                step.hold(work, step.bwd(i), step.bwd(i), f"channel slice workspace {op.name}")
            elif rows >= shape[0]:  # one slice: the whole tensor decoded, and the kernel's own workspace (an
                # op with weight blocks whose weight outsizes its input: oneDNN's reordered weight)
                work = max(kernel, 4 * weight if slicing.weight_blocks else 0, widened * sample * shape[0])
                step.hold(decodes * 4 * sample * shape[0] + work, step.bwd(i), step.bwd(i), f"workspace {op.name}")
            else:
                summed = slicing.weight_blocks * 4 * weight
                slices = max(4 * (slicing.workspace - (not decodes)), decodes * (4 + widened))
                step.hold(slices * rows * sample + summed, step.bwd(i), step.bwd(i), f"slice workspace {op.name}")
        elif kernel:
            step.hold(kernel, step.bwd(i), step.bwd(i), f"workspace {op.name}")
    return channel_sliced


def _forward_lifetimes(graph: TensorGraph) -> tuple[dict[str, int], dict[str, str], dict[str, bool], dict[str, int]]:
    """Per activation: the index of its producer op, the activation owning its storage (in-place ops share
    it), whether it needs a gradient, and the index of its last forward use (through in-place aliases too)."""
    producer: dict[str, int] = {}
    root: dict[str, str] = {}
    needs_grad: dict[str, bool] = {}
    last_use: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        trainable = any(f"{pid}_grad" in graph.tensors for pid in op.params)
        needed = op.role != "input" and (trainable or any(needs_grad.get(t, False) for t in op.input_tensors))
        for tid in op.input_tensors:
            last_use[tid] = last_use[root[tid]] = i
        for tid in op.outputs:
            producer[tid] = i
            needs_grad[tid] = needed
            in_place = op.attrs.get("inplace") and op.input_tensors
            root[tid] = root[op.input_tensors[0]] if in_place else tid
    return producer, root, needs_grad, last_use


def _rule_items(item: str, op: OpInfo, graph: TensorGraph, trainable: bool) -> list[str | tuple[int, int]]:
    """What one rule item saves for `op`: activation ids, or (numel, itemsize) of a byproduct."""
    output = graph.tensors[op.outputs[0]] if op.outputs else None
    if item == "inputs" or (item == "pair" and len(op.input_tensors) >= 2):
        if op.role == "gemm" and op.params and not trainable:
            return []  # a frozen GEMM needs no weight gradient, so it keeps no input
        return list(op.input_tensors)
    if output is None:
        return []
    if item == "output":
        return [output.id]
    if item == "pool" and any(d != 1 for d in output.shape[2:]):
        return list(op.input_tensors)
    if item == "indices":
        return [(output.numel, 8)]
    if item == "bnstats" and op.input_tensors:
        channels = graph.tensors[op.input_tensors[0]].shape[1]
        return [(channels * (4 if op.attrs.get("running_stats", True) else 2), 4)]
    dropping = op.attrs.get("p", 0.5) > 0 and op.attrs.get("training", True)
    if item == "mask" and dropping:
        return [(output.numel, 4)]
    if item == "channelmask" and dropping:
        return [(output.shape[0] * output.shape[1], 4)]
    return []


def measure_saved_bytes(model: nn.Module, example_input: torch.Tensor) -> int:
    """Bytes autograd really keeps for backward after one training-mode forward of `model` on `example_input`:
    every tensor passed to `torch.autograd.graph.saved_tensors_hooks`, deduplicated by untyped storage, the
    model's parameter storages excluded. The model's modes, buffers and torch's RNG state are restored after."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with training_mode(model):
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                output = model(example_input)
        except Exception as error:  # whatever the model raises becomes one clear line
            raise forward_error(type(model).__name__, model, example_input, error) from error
        del output  # saved tensors stay alive until here, so their storage addresses are distinct
    return sum(storages.values())
