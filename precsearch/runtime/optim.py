"""Weight updates that survive low precision: fp32 master weights, or low-precision weights updated with
nearest rounding, stochastic rounding or Kahan summation, and optimizer state held in a chosen format.

``LowPrecisionOptimizer`` wraps a torch SGD, Adam or AdamW, which computes its update in float32 on the weight
values; the wrapper decides what the model keeps:

* ``master_weights=True`` (Micikevicius et al. 2018): an fp32 master receives the update and the parameter holds
  ``quantize(master, weight_format)`` (rounded stochastically with ``update="stochastic"``).
* ``master_weights=False`` (pure 16-bit training, Zamirai et al.): the parameter is the low-precision weight, and
  the update ``u = quantize(new - old)`` (as pure 16-bit arithmetic would produce it) is applied with ``update=``

  - ``"nearest"``: ``w = Q(w + u)``; updates under half an ulp of ``w`` are lost;
  - ``"stochastic"``: ``w = SR(w + u)``, unbiased, so small updates survive on average;
  - ``"kahan"``: ``y = Q(u - c); s = Q(w + y); c = Qc(Qc(s - w) - y); w = s`` with a compensation buffer
    ``c`` in ``compensation_format`` (default: the weight's own format, 2 bytes per parameter for bf16).

Sums are formed in float32 and rounded once to the format, so a result differs from a correctly rounded
low-precision add only when the float32 sum itself was inexact and lands on a midpoint of the format.

Optimizer state (momentum, Adam moments) is rounded to ``state_format`` (one format, or one per state name)
after every step. Range rule: gradient-sized state needs at least 5 exponent bits (fp16's range, the narrowest
the seed papers use for gradients); Adam's second moments hold squared gradients, twice the exponent range, so 8.

Memory per parameter (``update_bytes_per_param``, bits / 8 so sub-byte formats count as packed): the weight's
bits, 4 bytes of master with ``master_weights``, the compensation format's bits with kahan, and each optimizer
state tensor's format (or fp32) bits (SGD: 1 tensor with momentum, else 0; Adam/AdamW: 2, 3 with amsgrad).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from precsearch.config.optimizer import STATE_MIN_EXP, UPDATES, UpdateConfig, state_specs
from precsearch.errors import PrecsearchError
from precsearch.formats.format import FloatFormat, get_format
from precsearch.formats.kernels import quantize

__all__ = ["SUPPORTED_OPTIMIZERS", "LowPrecisionOptimizer", "apply_update", "update_bytes_per_param", "from_config"]

log = logging.getLogger(__name__)

SUPPORTED_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam,
                                                                 "adamw": torch.optim.AdamW}
FormatSpec = str | FloatFormat


def _optimizer_kind(optimizer: torch.optim.Optimizer | str | type) -> str:
    if isinstance(optimizer, str):
        kind = optimizer.lower()
        if kind in SUPPORTED_OPTIMIZERS:
            return kind
    else:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        for kind, supported in SUPPORTED_OPTIMIZERS.items():
            if cls is supported:
                return kind
    name = optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", type(optimizer).__name__)
    raise PrecsearchError(f"optimizer {name} is not supported by LowPrecisionOptimizer: use torch.optim "
                          + ", ".join(cls.__name__ for cls in SUPPORTED_OPTIMIZERS.values()))


def _state_names(kind: str, group: Mapping[str, Any]) -> list[str]:
    """Names of the per-parameter float state tensors the optimizer keeps for a parameter group."""
    if kind == "sgd":
        return ["momentum_buffer"] if group.get("momentum", 0) else []
    return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad", False) else [])


def _check_state_range(kind: str, specs: Mapping[str, str]) -> None:
    for name, spec in specs.items():
        fmt = get_format(spec)
        relevant = name == "momentum_buffer" if kind == "sgd" else name != "momentum_buffer"
        if relevant and fmt.exp < STATE_MIN_EXP[name]:
            raise PrecsearchError(f"state format {fmt} has {fmt.exp} exponent bits, too few for {name} (needs >= "
                                  f"{STATE_MIN_EXP[name]}): use e.g. "
                                  f"{'bf16' if STATE_MIN_EXP[name] == 8 else 'fp16 or bf16'}")


def _bytes_per_param(kind: str, weight: FloatFormat, update: str, master_weights: bool, state_specs: Mapping[str, str],
                     compensation: FloatFormat | None, group: Mapping[str, Any]) -> dict[str, float]:
    low = not weight.is_fp32
    state_bits = sum(get_format(state_specs.get(name, "fp32")).bits for name in _state_names(kind, group))
    return {"weight": weight.bits / 8, "master_weight": 4.0 if master_weights and low else 0.0,
            "compensation": (compensation or weight).bits / 8 if update == "kahan" and low else 0.0,
            "optimizer_state": state_bits / 8}


def update_bytes_per_param(optimizer: torch.optim.Optimizer | str | type, config: UpdateConfig | Mapping[str, Any],
                           momentum: bool = True, amsgrad: bool = False) -> dict[str, float]:
    """Bytes per parameter of the weight, its fp32 master, its Kahan buffer and its optimizer state; ``momentum``
    (SGD) and ``amsgrad`` (Adam/AdamW) say which state tensors exist."""
    kind = _optimizer_kind(optimizer)
    cfg = config if isinstance(config, UpdateConfig) else UpdateConfig.from_dict(config)
    comp = None if cfg.compensation_format is None else get_format(cfg.compensation_format)
    group = {"momentum": 1.0 if momentum else 0.0, "amsgrad": amsgrad}
    specs = state_specs(cfg.state_format)
    _check_state_range(kind, specs)  # price only what LowPrecisionOptimizer accepts
    return _bytes_per_param(kind, get_format(cfg.weight_format), cfg.update, cfg.master_weights, specs, comp, group)


def apply_update(weight: torch.Tensor, delta: torch.Tensor, fmt: FormatSpec, update: str = "nearest",
                 compensation: torch.Tensor | None = None, compensation_format: FormatSpec | None = None,
                 generator: torch.Generator | None = None) -> None:
    """Add ``delta`` to the low-precision ``weight`` in place, by ``update`` rule (see the module docstring);
    ``compensation`` (Kahan only) is a buffer like ``weight``, zero at the start, updated in place."""
    if update not in UPDATES:
        raise PrecsearchError(f"unknown weight update {update!r}: use one of {', '.join(UPDATES)}")
    u = quantize(delta, fmt)
    if update == "nearest":
        weight.copy_(quantize(weight + u, fmt))
    elif update == "stochastic":
        weight.copy_(quantize(weight + u, fmt, rounding="stochastic", generator=generator))
    else:
        if compensation is None:
            raise PrecsearchError("update 'kahan' needs a compensation buffer (zeros like the weight)")
        cfmt = compensation_format or fmt
        y = quantize(u - compensation, fmt)
        s = quantize(weight + y, fmt)
        compensation.copy_(quantize(quantize(s - weight, cfmt) - y, cfmt))
        weight.copy_(s)


class LowPrecisionOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so its parameters live in ``weight_format`` (see the module docstring).

    ``weight_format`` is one format, or a mapping from parameter tensor to format (parameters missing from
    it, and fp32 ones, are left to the inner optimizer untouched); ``set_format`` changes one parameter's
    format later. Shares ``param_groups`` and ``state`` with the inner optimizer, so learning-rate schedulers
    and loss scalers work on either.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 weight_format: FormatSpec | Mapping[torch.Tensor, FormatSpec] = "bf16", update: str = "nearest",
                 master_weights: bool = True, state_format: str | Mapping[str, str] | None = None,
                 generator: torch.Generator | None = None, compensation_format: FormatSpec | None = None) -> None:
        self._kind = _optimizer_kind(optimizer)
        formats = weight_format if isinstance(weight_format, Mapping) else None
        comp_spec = None if compensation_format is None else str(get_format(compensation_format))
        for spec in {str(get_format(s)) for s in (formats.values() if formats is not None else [weight_format])}:
            UpdateConfig(weight_format=spec, update=update, master_weights=master_weights,
                         compensation_format=comp_spec)  # validates the combination for every weight format
        self._state_specs = state_specs(state_format)
        _check_state_range(self._kind, self._state_specs)
        self.optimizer, self.update, self.master_weights, self.generator = optimizer, update, master_weights, generator
        self._compensation_format = None if compensation_format is None else get_format(compensation_format)
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups, self.state = optimizer.param_groups, optimizer.state
        self._format: dict[torch.Tensor, FloatFormat] = {}
        self._master: dict[torch.Tensor, torch.Tensor] = {}
        self._compensation: dict[torch.Tensor, torch.Tensor] = {}
        with torch.no_grad():
            for p in self._params():
                fmt = get_format(formats.get(p, "fp32")) if formats is not None else get_format(weight_format)
                if fmt.is_fp32:
                    continue
                self._format[p] = fmt
                if master_weights:
                    self._master[p] = _fp32_copy(p)
                    p.copy_(self._round(self._master[p], fmt))
                else:
                    p.copy_(quantize(p.detach().float(), fmt))
                    if update == "kahan":
                        self._compensation[p] = torch.zeros_like(p)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _round(self, master: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
        rounding = "stochastic" if self.update == "stochastic" else "nearest"
        return quantize(master, fmt, rounding=rounding, generator=self.generator)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One inner step in float32 on the weight values, then the weights written back per the config."""
        if closure is not None:
            raise PrecsearchError("LowPrecisionOptimizer.step takes no closure: compute the loss before step()")
        active = [p for p in self._params() if p.grad is not None and p in self._format]
        old = {}
        for p in active:
            if self.master_weights:
                p.copy_(self._master[p])
            else:
                old[p] = p.detach().clone()
        self.optimizer.step()
        for p in active:
            fmt = self._format[p]
            if self.master_weights:
                self._master[p].copy_(p)
                p.copy_(self._round(self._master[p], fmt))
            else:
                new = p.detach().clone()
                p.copy_(old[p])
                apply_update(p, new - old[p], fmt, self.update, self._compensation.get(p),
                             self._compensation_format, self.generator)
        self._round_state()
        return None

    def _round_state(self) -> None:
        if not self._state_specs:
            return
        for p in self._params():
            state = self.state.get(p, {})
            for name, spec in self._state_specs.items():
                tensor = state.get(name)
                if isinstance(tensor, torch.Tensor) and tensor.shape == p.shape:
                    tensor.copy_(quantize(tensor, spec))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def set_format(self, param: torch.Tensor, fmt: FormatSpec) -> None:
        """Keep ``param`` in ``fmt`` from now on (the runtime calls this when its divergence guard promotes a weight).

        Without master weights the weight and its Kahan buffer are re-rounded to ``fmt`` (values already on
        its grid, as after a widening, are left as they are); with master weights the model's copy is rounded
        again from the master. ``fp32`` hands the parameter back to the inner optimizer.
        """
        if not any(param is p for p in self._params()):
            raise PrecsearchError("set_format: the parameter is not one this optimizer updates; pass one of its "
                                  "param_groups' parameters")
        fmt = get_format(fmt)
        if fmt.is_fp32:
            if param in self._master:
                param.copy_(self._master.pop(param))
            self._format.pop(param, None)
            self._compensation.pop(param, None)
            return
        UpdateConfig(weight_format=str(fmt), update=self.update, master_weights=self.master_weights,
                     compensation_format=None if self._compensation_format is None else str(self._compensation_format))
        self._format[param] = fmt
        if self.master_weights:
            if param not in self._master:  # copied once, not at every change of its format
                self._master[param] = _fp32_copy(param)
            master = self._master[param]
            param.copy_(self._round(master, fmt))
            return
        param.copy_(quantize(param.detach().float(), fmt))
        if self.update == "kahan":
            compensation = self._compensation.setdefault(param, torch.zeros_like(param))
            compensation.copy_(quantize(compensation, self._compensation_format or fmt))

    def master(self, param: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master copy of ``param`` (None without master weights or for fp32 parameters)."""
        return self._master.get(param)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of weights, fp32 masters, Kahan buffers and optimizer state, by the module's formula."""
        totals = {"weight": 0.0, "master_weight": 0.0, "compensation": 0.0, "optimizer_state": 0.0}
        for group in self.param_groups:
            for p in group["params"]:
                per = _bytes_per_param(self._kind, self._format.get(p, get_format("fp32")), self.update,
                                       self.master_weights, self._state_specs, self._compensation_format, group)
                for key, value in per.items():
                    totals[key] += value * p.numel()
        return {key: int(round(value)) for key, value in totals.items()}

    def state_dict(self) -> dict[str, Any]:
        params = self._params()
        return {"inner": self.optimizer.state_dict(),
                "master": {i: self._master[p].clone() for i, p in enumerate(params) if p in self._master},
                "compensation": {i: self._compensation[p].clone() for i, p in enumerate(params)
                                 if p in self._compensation},
                "formats": {i: self._format[p].name for i, p in enumerate(params) if p in self._format}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = sorted({"inner", "master", "compensation"} - set(state_dict))
        if missing:
            raise PrecsearchError(f"LowPrecisionOptimizer state lacks {', '.join(missing)}: pass its own state_dict()")
        self.optimizer.load_state_dict(state_dict["inner"])
        params = self._params()
        if "formats" in state_dict:  # (older checkpoints lack them: every parameter keeps its format)
            self._load_formats({int(i): name for i, name in state_dict["formats"].items()}, params)
        for key, table in (("master", self._master), ("compensation", self._compensation)):
            saved = {int(i): t for i, t in state_dict[key].items()}
            if set(saved) != {i for i, p in enumerate(params) if p in table}:
                raise PrecsearchError(f"LowPrecisionOptimizer state has {key} buffers for other parameters: "
                                      "load it into an optimizer built with the same settings")
            for i, tensor in saved.items():
                table[params[i]].copy_(tensor)
        with torch.no_grad():
            for p, master in self._master.items():
                p.copy_(self._round(master, self._format[p]))

    def _load_formats(self, formats: dict[int, str], params: list[torch.Tensor]) -> None:
        """Each parameter's format as saved (a promoted weight stays promoted); the buffers a format needs
        are made here and filled from the checkpoint by the caller."""
        for i, p in enumerate(params):
            if i not in formats:
                self._format.pop(p, None)
                self._master.pop(p, None)
                self._compensation.pop(p, None)
                continue
            self._format[p] = get_format(formats[i])
            if self.master_weights:
                if p not in self._master:
                    self._master[p] = _fp32_copy(p)
            elif self.update == "kahan":
                self._compensation.setdefault(p, torch.zeros_like(p))

    def __repr__(self) -> str:
        return (f"LowPrecisionOptimizer({type(self.optimizer).__name__}, update={self.update!r}, "
                f"master_weights={self.master_weights}, state={self._state_specs or 'fp32'})")


def from_config(optimizer: torch.optim.Optimizer, config: Mapping[str, Any],
                weight_format: FormatSpec | Mapping[torch.Tensor, FormatSpec] | None = None,
                generator: torch.Generator | None = None) -> LowPrecisionOptimizer:
    """A ``LowPrecisionOptimizer`` from a policy's ``optimizer`` dict (keys: ``UpdateConfig``'s fields);
    ``weight_format`` (e.g. the runtime's per-parameter formats from the policy) overrides the config's."""
    cfg = UpdateConfig.from_dict(config)
    if generator is None and cfg.seed is not None:
        generator = torch.Generator().manual_seed(cfg.seed)
    return LowPrecisionOptimizer(optimizer, weight_format=cfg.weight_format if weight_format is None else weight_format,
                                 update=cfg.update, master_weights=cfg.master_weights, state_format=cfg.state_format,
                                 generator=generator, compensation_format=cfg.compensation_format)


def _fp32_copy(p: torch.Tensor) -> torch.Tensor:
    """A parameter's fp32 master, laid out as the parameter."""
    return p.detach().clone(memory_format=torch.preserve_format).float()
