"""A proxy run that continues: one run gives a valid result at every length, and a run stopped anywhere goes on
from its checkpoint.

The schedule is warmup-stable-decay without the warmup (the cosine proxy starts at its peak rate too): the
rate stays at the recipe's ``lr``, and the run is read at a step s off a short decay branch, ``decay_steps(s)``
(a tenth of s) more steps on the batches that follow s with the rate falling to zero along a cosine, after
which the run goes back to its state at s. What a branch at s reads is therefore exactly a fresh run of
s + decay_steps(s) steps whose decay starts at s, and nothing before s depends on how long the run will be: a
calibration curve's point at s is the result of a proxy of that length, and a candidate passes its rungs
without starting again.

A run may end in one long decay instead (``decay_from``: confirmation's runs, from the proxy length to the
confirmation length): the rate falls along one cosine from that step to the run's end, and the end is read as
it is. So a run checkpointed at a reading (calibration's reference at L) goes on into that decay, and a run
that is longer than the proxy does not spend its extra steps at the proxy's peak rate, where a recipe that
trains at L can blow up at 3L whatever the precision (mobilenet_v2's, plain fp32 included).

The state at every evaluation (model and optimizer state dicts, which carry precsearch's training state:
promotions, loss scale, rounding counters; the global generators; the loop's own ``Progress``) is kept for
the branch's return and, given a checkpoint path, written there atomically (and so is the state every
``CHECKPOINT_EVERY`` steps); a run asked for a length at or past the checkpoint's step continues from it, bit
for bit the run that was not stopped. A checkpoint is data: it is read with ``torch.load(weights_only=True)``
(tensors and plain values only), since a run directory may come from someone else and an unrestricted
unpickler would run whatever code the file names.
"""

from __future__ import annotations

import hashlib
import io
import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from precsearch.config.policy import Policy
from precsearch.errors import PrecsearchError, clip
from precsearch.files import atomic_write_bytes

__all__ = ["CHECKPOINT_EVERY", "DECAY_FRACTION", "Progress", "State", "branch_steps", "check_checkpoints", "decay_lr",
           "decay_steps", "read_checkpoint", "run_tag", "write_checkpoint"]

DECAY_FRACTION = 0.1  # a branch at step s decays over a tenth of s: doubling points cost 0.2x the run in branches
CHECKPOINT_EVERY = 100  # steps between checkpoints (no branch) of a long stretch without evaluations


def decay_steps(step: int) -> int:
    return max(1, math.ceil(DECAY_FRACTION * step))


def branch_steps(readings: Iterable[int]) -> int:
    """Steps a continuing run trains in the decay branches of its readings (each reading has one)."""
    return sum(decay_steps(step) for step in readings)


def decay_lr(lr: float, index: int, length: int) -> float:
    """The rate of the ``index``-th (0-based) of ``length`` branch steps: a cosine from ``lr`` towards zero, as
    ``CosineAnnealingLR`` over ``length`` steps gives it."""
    return 0.5 * lr * (1.0 + math.cos(math.pi * index / length))


def run_tag(policy: Policy | None, seed: int, autocast: torch.dtype | None = None) -> str:
    """What a checkpoint must have been written by: this seed and this policy's training (None: plain fp32, under
    ``torch.autocast(autocast)`` when given). Its provenance only says where it came from (a trial retried after an
    interruption has a new number), so it is left out: the retry continues the run it retries."""
    text = (f"plain {autocast}" if autocast else "plain") if policy is None else policy.replace(provenance={}).to_json()
    return f"{seed}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


@dataclass
class Progress:
    """The loop's own record at a step: losses per step, the evaluated points, the divergence monitor's first
    loss and reason, the seconds trained so far, and the steps no result has counted yet (a run interrupted
    and continued costs what it would have cost uninterrupted, not only its last call's steps)."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    val_curve: list[list[float]] = field(default_factory=list)
    first_loss: float | None = None
    reason: str = ""
    elapsed: float = 0.0
    branch_steps: int = 0  # steps trained in decay branches, so far
    unreported: int = 0  # steps (branches included) a call trained that ended before returning its result
    decay: list[int] | None = None  # [the step it starts after, its last step]: the run's own decay, once in it


@dataclass(frozen=True)
class State:
    """The model's, the optimizer's and the global generators' state at one step, serialized; and a loss scaler's
    the model does not hold (torch.autocast's GradScaler, precsearch.train.autocast)."""

    data: bytes

    @classmethod
    def capture(cls, model: torch.nn.Module, optimizer: Any, device: torch.device, scaler: Any = None) -> State:
        buffer = io.BytesIO()
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                    "cuda_rng": cuda, "scaler": None if scaler is None else scaler.state_dict()}, buffer)
        return cls(buffer.getvalue())

    def restore(self, model: torch.nn.Module, optimizer: Any, device: torch.device, scaler: Any = None) -> None:
        saved = _load_data(io.BytesIO(self.data), "a checkpoint's training state", map_location=device)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        if scaler is not None:
            scaler.load_state_dict(saved["scaler"])
        torch.set_rng_state(saved["rng"])
        if saved["cuda_rng"] is not None:
            torch.cuda.set_rng_state(saved["cuda_rng"], device)


def write_checkpoint(path: Path, tag: str, state: State, progress: Progress) -> None:
    buffer = io.BytesIO()
    torch.save({"tag": tag, "state": state.data, "progress": asdict(progress)}, buffer)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())


def read_checkpoint(path: Path, tag: str, steps: int, decay: list[int] | None = None
                    ) -> tuple[State, Progress] | None:
    """The state a run of ``tag`` left at ``path`` at most ``steps`` steps in, and ending in ``decay`` ([step it
    starts after, last step]; None: branches only), or None: start from the beginning. A checkpoint of another
    run, one past ``steps``, one in another decay or one at a constant rate past where this run's decay starts
    is not one this run can continue."""
    if not path.is_file():
        return None
    saved_tag, state, progress = _read(path)
    if saved_tag != tag or progress.step > steps or not _continues(progress, decay):
        return None
    return state, progress


def _read(path: Path) -> tuple[Any, State, Progress]:
    """The run tag, training state and progress of the checkpoint at ``path``, or ``_not_ours``'s refusal."""
    saved = _load_data(path, f"checkpoint {path}")
    try:
        return saved["tag"], State(bytes(saved["state"])), Progress(**saved["progress"])
    except (KeyError, TypeError, ValueError) as error:
        raise _not_ours(f"checkpoint {path}", repr(error)) from None


def check_checkpoints(folder: Path) -> None:
    """Refuse, in one line naming every one, the checkpoints in ``folder`` that precsearch cannot continue (one
    naming code, a damaged or foreign file), before a resumed search trains anything: each would otherwise fail
    its own trial. Each file and the training state inside it are read as data only (``_load_data``)."""
    bad: list[str] = []
    reasons: list[str] = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        try:
            _load_data(io.BytesIO(_read(path)[1].data), f"checkpoint {path}")
        except _NotOurs as error:
            bad.append(path.name)
            reasons.append(error.why)
    if bad:
        raise PrecsearchError(f"{len(bad)} checkpoint(s) in {folder} are not ones precsearch wrote: {', '.join(bad)} "
                              f"(the first: {reasons[0]}); nothing in them was run; delete them to train those runs "
                              "from their start")


def _continues(progress: Progress, decay: list[int] | None) -> bool:
    """Whether a run ending in ``decay`` goes on from ``progress``: inside that same decay, or before it starts."""
    if progress.decay is not None:
        return progress.decay == decay
    return decay is None or progress.step <= decay[0]


def _load_data(source: Path | io.BytesIO, what: str, map_location: torch.device | None = None) -> dict[str, Any]:
    """``torch.load`` restricted to tensors and plain values: a file that names code, or is not precsearch's,
    is refused (``_not_ours``) without running anything."""
    try:
        saved = torch.load(source, weights_only=True, map_location=map_location)
    except Exception as error:  # torch raises UnpicklingError, RuntimeError, EOFError, ... as the file is
        raise _not_ours(what, _load_failure(error)) from None
    if not isinstance(saved, dict):
        raise _not_ours(what, f"it holds a {type(saved).__name__}")
    return saved


def _load_failure(error: Exception) -> str:
    """Why ``torch.load`` refused a file, in a few words: the line naming the global it would not load (its first
    line is advice on ``weights_only=False``, which a file from someone else must not get), else the first line."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines() if line.strip()]
    named = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else type(error).__name__)
    return clip(named.partition(" Please use")[0], 200)  # not the advice that follows on allowing it


class _NotOurs(PrecsearchError):
    """A checkpoint precsearch cannot read; ``why`` says what is wrong with it."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


def _not_ours(what: str, why: str) -> _NotOurs:
    """The one line a checkpoint precsearch cannot read gets, with the way on."""
    return _NotOurs(f"{what} is not one precsearch wrote ({why}); delete it to train that run from its start", why)
