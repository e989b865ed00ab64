"""What the runtime knows about each tensor id of the graph: its format now, how it rounds, what was seen of it.

``TensorState`` is made once by ``apply_policy`` and passed explicitly to everything that rounds. Every rounding is
one ``precsearch::round`` op (precsearch.runtime.ops) that also adds its overflow count to the tensor's row of a
device counts tensor, read once per step with the loss scaler's own test (``LossScaler.watch``:
``pending``/``settle``; or ``flush`` at the next training forward when the loop does not call ``scaler.step``):
one host synchronisation a step, however many tensors are rounded. Only training forwards (``counting``) count, so
evaluation never promotes. Nor does it draw: a forward outside training rounds stochastically from a copy of the
counter taken as it starts, so it sees the weights the next training forward will draw, the same every time, and
leaves training's draws as they were.

Divergence guard (Lee et al.): a tensor of a kind in ``promotion_kinds`` whose overflow fraction in a step reaches
``threshold`` is promoted to the high format for the rest of training (logged, listed in ``promotions``) and that
step is skipped. A gradient's overflow is reported to the loss scaler (a saturating format hides it from the
scaler's inf test). A saved tensor holding inf/NaN in a format without such codes cannot be packed faithfully:
that step is skipped too, with a WARNING.

Scaled formats (precsearch.formats.scaled) are rounded here too, as ``quantize_scaled`` rounds: the overflow count
is what a stale delayed scale saturated (current scaling never overflows; an MX block's floor rule may), the codes
are the element's plus e8m0 scales. A delayed recipe's ``AmaxHistory`` lives in its slot, is updated by training
forwards only and is part of ``state_dict``. They round to nearest only, and a scaled weight needs fp32 masters.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from precsearch.config.policy import Policy
from precsearch.config.spec import GRAD_KINDS
from precsearch.errors import PrecsearchError
from precsearch.formats import kernels
from precsearch.formats.format import FloatFormat, get_format
from precsearch.formats.scaled import AmaxHistory, ScaledFormat, any_format, e8m0_encode, expand_scales, scaled_values
from precsearch.graph.types import TensorGraph
from precsearch.runtime import ops

__all__ = ["Promotion", "Slot", "TensorState", "make_state"]

log = logging.getLogger(__name__)


class Promotion(NamedTuple):
    """A tensor moved to the high format: which, at which step, why (its overflow fraction), from and to."""

    id: str
    step: int
    fraction: float
    from_format: str
    to_format: str


class Slot:
    """One assigned tensor id: its format now, how it rounds, its row of the counts, and what was seen.

    ``fmt`` is the format of one value; for a scaled format, its element, and ``scaled`` the scaled format
    (None otherwise), with its amax ``history`` for a delayed recipe."""

    def __init__(self, tensor_id: str, kind: str, row: int, fmt: FloatFormat | ScaledFormat, rounding: str,
                 overflow: str | None) -> None:
        self.id, self.kind, self.row, self.assigned = tensor_id, kind, row, fmt.name
        self.assigned_low = isinstance(fmt, ScaledFormat) or not fmt.is_fp32
        self.rounding, self.overflow_mode = rounding, overflow
        self.promoted = False
        self.scaled = fmt if isinstance(fmt, ScaledFormat) else None
        self.fmt = fmt.element if isinstance(fmt, ScaledFormat) else fmt
        self.history = AmaxHistory(fmt.history) if isinstance(fmt, ScaledFormat) and fmt.history else None
        self.reset()

    def reset(self) -> None:
        self.calls = self.counted = self.overflowed = 0
        self.max_overflow = 0.0  # the largest fraction of one step
        self.pending = 0  # elements counted on the device this step, not read yet
        self.stat_sums: Counter[str] = Counter()
        self.stat_elements = 0

    @property
    def name(self) -> str:
        """The format in force, as a policy names it."""
        return self.fmt.name if self.scaled is None else self.scaled.name

    @property
    def is_low(self) -> bool:
        return self.scaled is not None or not self.fmt.is_fp32

    @property
    def rounds_alike_again(self) -> bool:
        """Whether rounding a value again gives the rounding it had (nearest, unscaled: a scaled slice would
        take another amax, a delayed scale moves), so that a weight's backward may round its master again."""
        return self.rounding != "stochastic" and self.scaled is None

    def rounds_again_as(self, source: Slot | None) -> bool:
        """Whether this slot's rounding of a value ``source`` rounded changes none of its values (the site plan's
        ``OpSites.gradient_from``): both low, the same format arguments, and no amax history (a delayed scale
        moves from step to step)."""
        return source is not None and source.is_low and source.args() == self.args() and self.history is None

    @property
    def holds_codes(self) -> bool:
        """Whether this slot's rounded values may be held as their codes (a low format of at most 16 bits): a
        weight gradient to the end of the backward (precsearch.runtime.gradients). A value its format has no code
        for (inf or NaN in a format without them) is held as the largest magnitude and counted unencodable: the
        step is skipped (``settle``)."""
        return self.is_low and self.fmt.packs

    def args(self) -> tuple[str, str, str]:
        """The format arguments of the round ops (a scaled format saturates)."""
        overflow = "saturate" if self.scaled is not None else self.overflow_mode or self.fmt.default_overflow
        return self.name, self.rounding, overflow


class TensorState:
    """What the runtime knows about each tensor id: format, promotion, statistics, and the device counters that
    ``round`` adds to and ``pending``/``settle`` (the scaler's once-a-step read) or ``flush`` read."""

    def __init__(self, slots: dict[str, Slot], high: FloatFormat, threshold: float | None, seed: int,
                 promotion_kinds: tuple[str, ...]) -> None:
        self.slots, self.high, self.threshold, self.promotion_kinds = slots, high, threshold, promotion_kinds
        self.promotions: list[Promotion] = []
        self.step = 0
        self.counting = False  # this forward is a training forward: count and gather statistics
        self.graph_rounds = False  # this forward is a compiled step's, whose backward rounds the weight gradients
        self.stats_due = False
        self.on_promote: list[Callable[[Slot], None]] = []
        self.on_training_forward: list[Callable[[], None]] = []  # called as each training forward starts
        self._seed = seed
        self._counts: list[torch.Tensor] = []  # per slot row: [overflowed, unencodable] this step, on the device
        self._uncounted: torch.Tensor | None = None  # what a rounding that counts nothing adds to, never read
        self._seeds: torch.Tensor | None = None
        self._outside_training = False  # a forward outside training has started: it draws from ``_drawn``
        self._drawn: torch.Tensor | None = None  # that forward's copy of ``_seeds``
        self._compiled: Callable[[], torch.Tensor] | None = None  # a compiled step's counts, read when settled
        self._dirty = False
        self._warned_unencodable = self._warned_copied_gradient = False

    def start_forward(self, training: bool, stats_every: int | None) -> None:
        """A forward starts: counts left unread (no ``scaler.step`` in the loop) are read, once per step; a
        training forward counts, and gathers statistics every ``stats_every``-th step."""
        self.flush()
        if training:
            self.step += 1
            for callback in self.on_training_forward:
                callback()
        self.counting = training
        self._outside_training, self._drawn = not training, None
        self.stats_due = training and bool(stats_every) and self.step % stats_every == 0

    def _op_state(self, x: torch.Tensor, slot: Slot | None, count: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """What a rounding of ``x`` in ``slot`` passes its op, on ``x``'s device: the counts it adds to (the
        slot's own tensor, ``count`` and ``x`` not empty, then accounted; else one never read; a kernel adds
        to a whole tensor, not to a view at an offset) and the stochastic-rounding seed."""
        device = x.device
        if self._uncounted is None or self._uncounted.device != device:
            self.flush()
            self._counts = [torch.zeros(2, dtype=torch.int64, device=device) for _ in self.slots]
            self._uncounted = torch.zeros(2, dtype=torch.int64, device=device)
            self._seeds = torch.full((), self._seed, dtype=torch.int64, device=device)
        seeds = self._seeds
        if self._outside_training:
            if self._drawn is None or self._drawn.device != device:
                self._drawn = self._seeds.clone()
            seeds = self._drawn
        if not (count and x.numel() > 0):
            return self._uncounted, seeds
        self._account(x, slot)
        return self._counts[slot.row], seeds

    def round(self, x: torch.Tensor, slot: Slot, with_codes: bool = False,
              count: bool = True) -> tuple[torch.Tensor, ops.Codes | None]:
        """``x`` in the slot's format (a new tensor), its codes (``with_codes``, when the format fits 16 bits),
        and the overflow counted on the device (``count``)."""
        counts, seeds = self._op_state(x, slot, count)
        if slot.scaled is not None:
            return self._round_scaled(x, slot, counts, with_codes, count, in_place=False)
        rounded, codes = ops.round(x, counts, *slot.args(), seeds, with_codes)
        return rounded, ops.Codes(codes, slot.fmt.name) if codes.numel() else None

    def round_(self, x: torch.Tensor, slot: Slot, with_codes: bool = False, count: bool = True) -> ops.Codes | None:
        """``round`` in place: its codes only."""
        counts, seeds = self._op_state(x, slot, count)
        if slot.scaled is not None:
            return self._round_scaled(x, slot, counts, with_codes, count, in_place=True)[1]
        codes = ops.round_(x, counts, *slot.args(), seeds, with_codes)
        return ops.Codes(codes, slot.fmt.name) if codes.numel() else None

    def _round_scaled(self, x: torch.Tensor, slot: Slot, counts: torch.Tensor, with_codes: bool, count: bool,
                      in_place: bool) -> tuple[torch.Tensor, ops.Codes | None]:
        """``round``/``round_`` of a scaled slot, as ``quantize_scaled`` rounds: ``x`` divided by its scales (over
        ``x`` itself with ``in_place``) goes through the element's one-pass kernel in place, then times its scales,
        so the step holds what an unscaled rounding holds. The kernel counts an inf input as an overflow, which
        ``quantize_scaled`` does not (no scale saturates it): those are taken back. A forward that counts nothing
        (evaluation) reads a delayed scale but records no amax."""
        history = slot.history
        scaled, scales, amax = scaled_values(x, slot.scaled, None if history is None else history.amaxes, in_place)
        if history is not None and count:
            history.update(amax)
        if count and self.stats_due:  # of its scaled-down values
            self._gather_stats(scaled, slot)
        if slot.fmt.has_inf:
            counts[0].sub_(scaled.isinf().sum())
        packs = with_codes and slot.fmt.packs
        _, element_codes, _ = kernels.round_and_count_fn(slot.fmt.name, slot.rounding, "saturate", packs, True)(
            scaled, self._seeds, counts)
        rounded = scaled.mul_(expand_scales(scales, slot.scaled, x.shape))
        codes = ops.Codes(element_codes, slot.fmt.name, slot.scaled, e8m0_encode(scales)) if packs else None
        if in_place and rounded is not x:  # (a non-contiguous x, or blocks that needed padding)
            x.copy_(rounded)
            return x, codes
        return rounded, codes

    def round_again(self, x: torch.Tensor, args: tuple[str, str, str], in_place: bool = False) -> torch.Tensor:
        """``x`` rounded again as an earlier rounding was (``args``: its ``Slot.args()``), counting nothing:
        its overflow was counted the first time. No gradient flows through it."""
        counts, seeds = self._op_state(x, None, count=False)
        with torch.no_grad():
            if in_place:
                ops.round_(x, counts, *args, seeds, False)
                return x
            return ops.round(x, counts, *args, seeds, False)[0]

    def warn_gradient_copied(self, slot: Slot) -> None:
        """Once: a gradient that may be rounded over itself arrived non-contiguous, so it was rounded into a new
        tensor."""
        if not self._warned_copied_gradient:
            self._warned_copied_gradient = True
            log.warning("the gradient %s arrived non-contiguous (a channels_last model?): such gradients are "
                        "rounded into a new tensor (one more float32 block each), not over themselves", slot.id)

    def count_unchanged(self, x: torch.Tensor, slot: Slot, count: bool = True) -> None:
        """Count ``x``, already rounded as unscaled ``slot`` rounds, as rounding it again would: its elements and
        statistics, no overflow (each value has its code)."""
        if count and x.numel() > 0:
            self._account(x, slot)

    def _account(self, x: torch.Tensor, slot: Slot) -> None:
        slot.calls += 1
        slot.pending += x.numel()
        self._dirty = True
        if self.stats_due and slot.scaled is None:  # a scaled slot's are of its scaled-down values
            self._gather_stats(x, slot)

    def _gather_stats(self, x: torch.Tensor, slot: Slot) -> None:
        n = x.numel()
        slot.stat_sums.update({key: value * n for key, value in kernels.stats(x.detach(), slot.fmt).items()})
        slot.stat_elements += n

    # -- the once-a-step read ---------------------------------------------------------------------------

    def count_compiled(self, counts: Callable[[], torch.Tensor]) -> None:
        """Take a compiled step's counts (precsearch.runtime.compiled): ``counts()`` gives (overflowed,
        elements, roundings, unencodable) per row, the forward's and, once the backward ran, the backward's; read
        with the others."""
        self.flush()
        self._compiled, self._dirty = counts, True

    def seed_tensor(self, device: torch.device) -> torch.Tensor:
        """The stochastic-rounding seed on ``device`` (an int64 tensor, advanced by whoever rounds with it)."""
        self._op_state(torch.empty(0, device=device), None, count=False)
        return self._seeds

    def pending(self) -> torch.Tensor | None:
        """This step's unread counts, one tensor: (overflowed, unencodable) per row from the eager roundings,
        then (overflowed, elements, roundings, unencodable) per row from a compiled step, if one ran."""
        if not self._dirty:
            return None
        if self._compiled is None:
            return torch.cat(self._counts)
        compiled = self._compiled().flatten()
        eager = (torch.cat(self._counts).to(compiled.device) if self._counts
                 else compiled.new_zeros(2 * len(self.slots)))
        return torch.cat([eager, compiled])

    def settle(self, values: list[int]) -> tuple[bool, bool]:
        """Take this step's counts (``pending``): update statistics, promote, and say whether a gradient
        overflowed and whether the step must be skipped (a promotion, a saved tensor the format could not hold,
        or an inf or NaN gradient held as codes, which hold neither)."""
        overflowed, skip, unencodable = False, False, 0
        compiled = values[2 * len(self.slots):]
        for slot in self.slots.values():
            over, bad = values[2 * slot.row], values[2 * slot.row + 1]
            if compiled:
                over += compiled[4 * slot.row]
                slot.pending += compiled[4 * slot.row + 1]
                slot.calls += compiled[4 * slot.row + 2]
                bad += compiled[4 * slot.row + 3]
            if not slot.pending:
                continue
            fraction = over / slot.pending
            slot.counted += slot.pending
            slot.overflowed += over
            slot.max_overflow = max(slot.max_overflow, fraction)
            slot.pending = 0
            if slot.kind in GRAD_KINDS:  # an inf or NaN gradient: the step overflowed (its codes are not read)
                overflowed = overflowed or bool(over or bad)
                skip = skip or bool(bad)
            else:
                unencodable += bad
            if self.threshold is not None and fraction >= self.threshold and self._promote(slot, fraction):
                skip = True
        if unencodable:
            skip = True
            if not self._warned_unencodable:
                self._warned_unencodable = True
                log.warning("step %d: %d saved value(s) were inf/NaN in a format without such codes, so their "
                            "packed copies are wrong: the step is skipped (training has likely diverged)",
                            self.step, unencodable)
        if self._counts:
            torch._foreach_zero_(self._counts)
        self._compiled, self._dirty = None, False
        return overflowed, skip

    def flush(self) -> None:
        """Read and settle pending counts now (when the loop did not call ``scaler.step``)."""
        values = self.pending()
        if values is not None:
            self.settle(values.tolist())

    def _promote(self, slot: Slot, fraction: float) -> bool:
        if (slot.promoted or (slot.scaled is None and slot.fmt == self.high) or not slot.is_low
                or slot.kind not in self.promotion_kinds):
            return False
        old = slot.name
        slot.fmt, slot.scaled, slot.promoted = self.high, None, True
        for callback in self.on_promote:
            callback(slot)
        self.promotions.append(Promotion(slot.id, self.step, fraction, old, self.high.name))
        log.info("promoted %s from %s to %s at step %d: %.2f%% of its values overflowed",
                 slot.id, old, self.high.name, self.step, 100 * fraction)
        return True

    # -- reports ----------------------------------------------------------------------------------------

    def table(self) -> dict[str, dict[str, Any]]:
        self.flush()
        table: dict[str, dict[str, Any]] = {}
        for tensor_id, slot in self.slots.items():
            if not slot.assigned_low or not slot.calls:  # a compiled step counts fp32 rows too
                continue
            row: dict[str, Any] = {"kind": slot.kind, "format": slot.name, "assigned": slot.assigned,
                                   "promoted": slot.promoted, "calls": slot.calls}
            if slot.counted:
                row["overflow"] = slot.overflowed / slot.counted
                row["max_overflow"] = slot.max_overflow
            if slot.stat_elements:
                row.update({key: value / slot.stat_elements for key, value in slot.stat_sums.items()})
                row.setdefault("overflow", row.get("overflow", 0.0))
            table[tensor_id] = row
        return table

    def reset(self) -> None:
        self.flush()
        for slot in self.slots.values():
            slot.reset()

    # -- checkpoints --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What training must carry over: the step, the promotions, the stochastic-rounding counter and the
        delayed scales' amax histories."""
        self.flush()
        return {"step": self.step, "promotions": [list(p) for p in self.promotions],
                "rounding_seed": self._seed if self._seeds is None else int(self._seeds),
                "amax_histories": {tensor_id: slot.history.state_dict() for tensor_id, slot in self.slots.items()
                                   if slot.history is not None}}

    def load_state_dict(self, state: Mapping[str, Any]) -> list[Slot]:
        """Restore ``state_dict()``; returns the slots promoted by it (the caller tells the optimizers)."""
        unknown = [p[0] for p in state["promotions"] if p[0] not in self.slots]
        if unknown:
            raise PrecsearchError(f"checkpoint promotes {unknown[0]!r}, which this policy does not assign; load it "
                                  "into a model wrapped with the policy it was trained under")
        histories = state.get("amax_histories", {})  # (none before scaled formats)
        strangers = [tensor_id for tensor_id in histories
                     if tensor_id not in self.slots or self.slots[tensor_id].history is None]
        if strangers:
            raise PrecsearchError(f"checkpoint holds an amax history for {strangers[0]!r}, which this policy does not "
                                  "scale with a delayed recipe; load it under the policy it was trained with")
        for tensor_id, history in histories.items():
            self.slots[tensor_id].history.load_state_dict(history)
        self.step = int(state["step"])
        self.promotions = [Promotion(*p) for p in state["promotions"]]
        self._seed = int(state["rounding_seed"])
        if self._seeds is not None:
            self._seeds.fill_(self._seed)
        promoted = []
        for promotion in self.promotions:
            slot = self.slots[promotion.id]
            if not slot.promoted:
                slot.fmt, slot.scaled, slot.promoted = get_format(promotion.to_format), None, True
                promoted.append(slot)
        return promoted


def make_state(graph: TensorGraph, policy: Policy, seed: int) -> TensorState:
    """One slot per assignable tensor id of ``graph``, in the format and rounding ``policy`` gives it."""
    slots = {}
    stochastic_update = policy.optimizer.get("update") == "stochastic"
    for row, tensor_id in enumerate(graph.assignable_ids()):
        info = graph.tensors[tensor_id]
        fmt = any_format(policy.format_for(info))
        rounding = policy.rounding.get(info.kind, "nearest")
        if rounding == "nearest" and policy.ties == "away":
            rounding = "nearest_away"
        if info.kind == "weight" and policy.master_weights and stochastic_update:
            rounding = "stochastic"  # the master's rounding to the working copy is the weight update
        if isinstance(fmt, ScaledFormat):
            _check_scaled(tensor_id, info.kind, fmt, rounding, policy.master_weights)
        slots[tensor_id] = Slot(tensor_id, info.kind, row, fmt, rounding, policy.overflow.get(info.kind))
    return TensorState(slots, get_format(policy.high_format), policy.promotion_threshold, seed,
                       promotion_kinds=policy.promotion_kinds)


def _check_scaled(tensor_id: str, kind: str, fmt: ScaledFormat, rounding: str, master_weights: bool) -> None:
    """What the runtime does not do with scaled formats, refused at wrapping with the fix."""
    if rounding == "stochastic":
        raise PrecsearchError(f"{tensor_id}: scaled format {fmt} rounds to nearest only; set rounding.{kind}: nearest "
                              "(and no stochastic weight update) or give it an unscaled format")
    if kind == "weight" and not master_weights:
        raise PrecsearchError(f"{tensor_id}: scaled weight format {fmt} needs fp32 master weights (an optimizer keeps "
                              "no scales); set master_weights: true")
