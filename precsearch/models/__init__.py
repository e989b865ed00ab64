"""The model zoo: the paper's four CNNs in CIFAR form, a tiny CNN, a narrow patch-stem CNN, and user models.

`build("resnet18", width=0.25, num_classes=100)` or `build("resnet18:width=0.25,classes=100")`;
`build("mypackage.models:make_net", depth=3)` imports `mypackage.models` and calls `make_net(depth=3)`.
All zoo models take (N, 3, 32, 32) input (they pool adaptively, so other sizes work too).

A spec read from a file is data: ``check_trusted`` refuses one that names code unless the user named it too.
Sizes are refused before anything is allocated: a zoo model is first built on the meta device (shapes only),
and ``check_fits`` prices a model and one training batch against this machine's memory before data is loaded.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import os
import shlex
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from precsearch.errors import PrecsearchError, described, echo, run_user_code
from precsearch.models.common import TooNarrow
from precsearch.models.mobilenet import mobilenet_v2
from precsearch.models.narrow import narrow_cnn
from precsearch.models.resnet import resnet18
from precsearch.models.shufflenet import shufflenet_v2
from precsearch.models.squeezenet import squeezenet
from precsearch.models.tiny import tiny_cnn

__all__ = ["INPUT_SHAPE", "NAMES", "OPTIONS", "build", "check_fits", "check_trusted", "machine_memory",
           "is_spec", "names_code", "parse_model_spec", "same_model"]

_ZOO: dict[str, Callable[..., nn.Module]] = {"resnet18": resnet18, "mobilenet_v2": mobilenet_v2,
                                              "shufflenet_v2": shufflenet_v2, "squeezenet": squeezenet,
                                              "tiny_cnn": tiny_cnn, "narrow_cnn": narrow_cnn}
NAMES: tuple[str, ...] = tuple(_ZOO)
OPTIONS: tuple[str, ...] = ("width", "num_classes")
INPUT_SHAPE: tuple[int, int, int] = (3, 32, 32)
_ALIASES = {"classes": "num_classes"}


def _parse_value(text: str, key: str, spec: str) -> Any:
    """Option value from text: int, then float, then true/false, else the string itself. A number must be plain
    ASCII digits: Python's int() and float() also read ``1_0`` as 10 (and other scripts' digits)."""
    for convert in (int, float):
        try:
            value = convert(text)
        except ValueError:
            continue
        if "_" in text or not text.isascii():
            raise PrecsearchError(f"option {key}={text} in model spec {echo(spec)}: write the number in plain digits, "
                                  f"without underscores ({value!r})")
        return value
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return text


def _parse_options(text: str, spec: str) -> dict[str, Any]:
    """`key=value,key=value` into a dict, `classes` renamed to `num_classes`."""
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.isidentifier() or not value:
            raise PrecsearchError(f"bad option {echo(item)} in model spec {echo(spec)}; write key=value,...")
        key = _ALIASES.get(key, key)
        if key in options:
            raise PrecsearchError(f"option {echo(key)} given twice in model spec {echo(spec)}; give it once")
        options[key] = _parse_value(value, key, spec)
    return options


def parse_model_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split `name[:key=value,...]` or `package.module:factory[:key=value,...]` into (name, options). A zoo name
    has no dot; a factory path is `module:attribute`, where a module without a dot is accepted when it is not a
    zoo name and the part after the first colon is a name, not options. Numbers become int or float; `classes=`
    is read as `num_classes=`."""
    parts = spec.strip().split(":")
    head = parts[0].strip()
    if not head:
        raise PrecsearchError(f"empty model name in spec {echo(spec)}; give a zoo name ({', '.join(NAMES)}) "
                              "or package.module:factory")
    is_factory = "." in head or (head not in _ZOO and len(parts) > 1 and parts[1].strip().isidentifier())
    if is_factory:
        if len(parts) < 2 or not parts[1].strip().isidentifier() or len(parts) > 3:
            raise PrecsearchError(f"bad factory path {echo(spec)}; write package.module:factory[:key=value,...]")
        return f"{head}:{parts[1].strip()}", _parse_options(parts[2] if len(parts) == 3 else "", spec)
    if len(parts) > 2:
        raise PrecsearchError(f"bad model spec {echo(spec)}; write name[:key=value,...], e.g. resnet18:width=0.5")
    return head, _parse_options(parts[1] if len(parts) == 2 else "", spec)


def names_code(spec: str) -> bool:
    """Whether ``spec`` names code to import and run (a package.module:factory), not a zoo model."""
    return ":" in parse_model_spec(spec)[0]


def is_spec(text: str) -> bool:
    """Whether ``text`` is a model spec the command line builds (a zoo name or a factory path, with options), not
    a model's class name (what a policy made in Python records, ``TensorGraph.model_name``)."""
    try:
        name, _ = parse_model_spec(text)
    except PrecsearchError:
        return False
    return name in _ZOO or ":" in name


def same_model(spec: str, other: str) -> bool:
    """Whether two specs name the same model with the same options (spacing and number spelling aside)."""
    return parse_model_spec(spec) == parse_model_spec(other)


def check_trusted(spec: Any, source: str, trusted: str | None) -> str:
    """``spec``, a model read from ``source`` (a file, a study): files are data, so it may name a zoo model but
    not code, unless the user named that same spec (``trusted``, the command line's --trust-model). Someone who
    hands over a run directory or a policy must not be able to run code on the receiver's machine."""
    if not isinstance(spec, str):
        raise PrecsearchError(f"{source}: model must be a model spec string, not {echo(spec)}; the file was edited or "
                              "damaged")
    if trusted is not None and not same_model(spec, trusted):
        raise PrecsearchError(f"--trust-model {echo(trusted)} is not the model {source} names ({echo(spec)}); name "
                              "that spec, as the file writes it, or leave --trust-model out")
    if trusted is None and names_code(spec):
        raise PrecsearchError(f"{source} names the model factory {echo(spec)}, code that would run here; a file is "
                              "data, so it is refused: read that code, and if you trust it, pass "
                              f"--trust-model {shlex.quote(spec)}")
    return spec


def _is_number(value: Any) -> bool:
    """True for int and float, not bool (a bool is an int to Python, never a width or a class count)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_zoo_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Validate the zoo model's name, `width` (positive number) and `num_classes` (positive integer)."""
    if name not in _ZOO:
        close = difflib.get_close_matches(name, NAMES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise PrecsearchError(f"unknown model {name!r}{hint}; choose one of {', '.join(NAMES)} "
                              "or give a factory as package.module:function")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise PrecsearchError(f"unknown option(s) {', '.join(unknown)} for model {name!r}; "
                              f"allowed: {', '.join(OPTIONS)} (classes= is an alias of num_classes)")
    checked = dict(options)
    if "width" in checked:
        width = checked["width"]
        if not _is_number(width) or not math.isfinite(width) or width <= 0:
            raise PrecsearchError(f"width={width!r} for model {name!r} must be a positive number, e.g. 0.25")
        checked["width"] = float(width)
    if "num_classes" in checked:
        classes = checked["num_classes"]
        if not _is_number(classes) or not float(classes).is_integer() or classes < 1:
            raise PrecsearchError(f"num_classes={classes!r} for model {name!r} must be a positive integer")
        checked["num_classes"] = int(classes)
    return checked


def _load_factory(path: str) -> Callable[..., Any]:
    """Import `module:attribute` and return the attribute, which must be callable."""
    module_name, _, attribute = path.partition(":")
    module = run_user_code(f"importing module {module_name!r} for model factory {path!r}",
                           lambda: _import(module_name, path))
    factory = getattr(module, attribute, None)
    if factory is None:
        raise PrecsearchError(f"module {module_name!r} has no attribute {attribute!r} "
                              f"(model factory {path!r}); check the name after the colon")
    if not callable(factory):
        raise PrecsearchError(f"model factory {path!r} is a {type(factory).__name__}, not a callable")
    return factory


def _import(module_name: str, path: str) -> Any:
    """The module of factory ``path``; one that cannot be found (or imports one that cannot) in one line."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        hint = "" if "." in module_name else f" (or use a zoo model: {', '.join(NAMES)})"
        raise PrecsearchError(f"cannot import module {module_name!r} for model factory {path!r} ({exc}); "
                              f"install it or add its folder to PYTHONPATH{hint}") from exc


def _check_factory_options(path: str, factory: Callable[..., Any], options: dict[str, Any]) -> None:
    """Fail with the factory's parameter names when it cannot take `options`."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # no introspectable signature (some builtins); let the call decide
    try:
        signature.bind(**options)
    except TypeError as exc:
        accepted = ", ".join(signature.parameters) or "no options"
        raise PrecsearchError(f"model factory {path!r} cannot take options {sorted(options)} ({exc}); "
                              f"it accepts: {accepted}") from exc


def machine_memory() -> int:
    """Bytes of physical memory of this machine."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gib(size: int) -> str:
    return f"{size / 2**30:.3g} GiB"


def _refuse_past_memory(what: str, parts: dict[str, int], fix: str) -> None:
    """A one-line refusal when ``parts`` (bytes by what holds them) add up to more than the machine's memory."""
    memory, total = machine_memory(), sum(parts.values())
    if total > memory:
        shown = ", ".join(f"{name} {_gib(size)}" for name, size in parts.items())
        raise PrecsearchError(f"{what} needs at least {_gib(total)} ({shown}), more than this machine's "
                              f"{_gib(memory)} of memory; {fix}")


def _zoo_on_meta(name: str, options: dict[str, Any]) -> nn.Module:
    """Zoo model ``name`` built on the meta device: its shapes, with nothing allocated. A width that leaves a
    layer no channels is refused with the model's smallest width; sizes no tensor can have, as too large."""
    try:
        with torch.device("meta"):
            return _ZOO[name](**options)
    except TooNarrow:
        raise PrecsearchError(f"width={options['width']!r} leaves a layer of {name} with no channels; give width "
                              f">= {_smallest_width(name, options)!r}") from None
    except (RuntimeError, TypeError, OverflowError) as error:
        if "overflow" not in str(error).lower():  # only sizes past what torch can index are refused as such
            raise
        settings = ", ".join(f"{key}={value!r}" for key, value in options.items())
        raise PrecsearchError(f"{name} at {settings} has tensors too large for any memory ({described(error)}); "
                              "lower its width or classes") from None


def _smallest_width(name: str, options: dict[str, Any]) -> float:
    """The least width at which no layer of zoo model ``name`` is left without channels: each try raises the
    width to what the narrowest failing layer needs, until none fails."""
    width = options["width"]
    while True:
        try:
            with torch.device("meta"):
                _ZOO[name](**{**options, "width": width})
            return width
        except TooNarrow as narrow:
            width = narrow.smallest


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers (on the meta device too: only their shapes are read)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in (*model.parameters(), *model.buffers()))


def check_fits(model_spec: str, batch_size: int, image_size: int) -> None:
    """Refuse, before any data is loaded or tensor allocated, training ``model_spec`` on batches of
    ``batch_size`` square images that this machine's memory cannot hold. What is priced is a floor of what a
    training step holds at once: one float32 batch, the weights, and the largest activation of a forward on
    the meta device. A user factory is not built here (that would run its code twice), so only its batch is."""
    channels = INPUT_SHAPE[0]
    what = f"training {model_spec} on batches of {batch_size} images of {channels}x{image_size}x{image_size}"
    fix = "lower the model's width, the image size or the batch size"
    batch_shape = (batch_size, channels, image_size, image_size)
    parts = {"one batch": math.prod(batch_shape) * torch.finfo(torch.float32).bits // 8}
    _refuse_past_memory(what, parts, fix)
    name, options = parse_model_spec(model_spec)
    if ":" in name:
        return
    model = _zoo_on_meta(name, _check_zoo_options(name, options))
    parts["weights"] = _weight_bytes(model)
    _refuse_past_memory(what, parts, fix)
    largest = 0

    def measure(module: nn.Module, inputs: Any, output: Any) -> None:
        nonlocal largest
        if isinstance(output, torch.Tensor):
            largest = max(largest, output.numel() * output.element_size())

    hooks = [module.register_forward_hook(measure) for module in model.modules()]
    try:
        _meta_forward(model, batch_shape)
    except (RuntimeError, ValueError) as error:  # a layer's output would have no pixels left
        raise PrecsearchError(f"{name} cannot take images of {image_size}x{image_size} ({described(error)}); give "
                              f"an image size >= {_smallest_image(model, batch_size, image_size)}") from None
    finally:
        for hook in hooks:
            hook.remove()
    parts["its largest activation"] = largest
    _refuse_past_memory(what, parts, fix)


def _meta_forward(model: nn.Module, shape: tuple[int, ...]) -> None:
    """``model``'s forward on the meta device at input ``shape``: its shapes, nothing computed or allocated."""
    with torch.no_grad():
        model(torch.empty(shape, device="meta"))


def _smallest_image(model: nn.Module, batch_size: int, too_small: int) -> int:
    """The least square image size above ``too_small`` that meta ``model`` takes in batches of ``batch_size`` (a
    training BatchNorm needs two values a channel): doubling to one that runs, then halving the gap (a model that
    takes a size takes every larger one)."""
    def runs(size: int) -> bool:
        try:
            _meta_forward(model, (batch_size, INPUT_SHAPE[0], size, size))
        except (RuntimeError, ValueError):
            return False
        return True

    low, high = too_small, max(2 * too_small, 2)  # low fails; find a high that runs
    while not runs(high):
        if high > 2**16:
            raise PrecsearchError(f"{type(model).__name__} runs on no image size up to {high}; check the model")
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if runs(middle) else (middle, high)
    return high


def build(name: str, **options: Any) -> nn.Module:
    """Build a zoo model or call a user factory; `name` may carry options (`resnet18:width=0.5`), which keyword
    options override. Zoo options: `width` (channel multiplier, default 1.0) and `num_classes` (default 10;
    `classes` is accepted too). Initialization draws from torch's global RNG, so `torch.manual_seed(s)` before
    `build` makes it deterministic."""
    model_name, spec_options = parse_model_spec(name)
    for alias, target in _ALIASES.items():
        if alias in options:
            if target in options:
                raise PrecsearchError(f"give either {alias}= or {target}= for model {model_name!r}, not both")
            options[target] = options.pop(alias)
    merged = {**spec_options, **options}
    if ":" in model_name:
        factory = _load_factory(model_name)
        _check_factory_options(model_name, factory, merged)
        model = run_user_code(f"model factory {model_name!r}", lambda: factory(**merged))
        if not isinstance(model, nn.Module):
            raise PrecsearchError(f"model factory {model_name!r} returned {type(model).__name__}, "
                                  "expected a torch.nn.Module")
        return model
    checked = _check_zoo_options(model_name, merged)
    meta = _zoo_on_meta(model_name, checked)  # refused here, before a layer allocates its weights
    _refuse_past_memory(f"model {name}", {"weights": _weight_bytes(meta)}, "lower its width or classes")
    return _ZOO[model_name](**checked)
