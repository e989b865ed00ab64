"""The model zoo: the paper's four CNNs in CIFAR form, a tiny CNN, a narrow patch-stem CNN, and user models.

`build("resnet18", width=0.25, num_classes=100)` or `build("resnet18:width=0.25,classes=100")`;
`build("mypackage.models:make_net", depth=3)` imports `mypackage.models` and calls `make_net(depth=3)`.
All zoo models take (N, 3, 32, 32) input (they pool adaptively, so other sizes work too).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
from collections.abc import Callable
from typing import Any

from torch import nn

from precsearch.errors import PrecsearchError, user_code_error
from precsearch.models.mobilenet import mobilenet_v2
from precsearch.models.narrow import narrow_cnn
from precsearch.models.resnet import resnet18
from precsearch.models.shufflenet import shufflenet_v2
from precsearch.models.squeezenet import squeezenet
from precsearch.models.tiny import tiny_cnn

__all__ = ["INPUT_SHAPE", "NAMES", "OPTIONS", "build", "parse_model_spec"]

_ZOO: dict[str, Callable[..., nn.Module]] = {
    "resnet18": resnet18,
    "mobilenet_v2": mobilenet_v2,
    "shufflenet_v2": shufflenet_v2,
    "squeezenet": squeezenet,
    "tiny_cnn": tiny_cnn,
    "narrow_cnn": narrow_cnn,
}
NAMES: tuple[str, ...] = tuple(_ZOO)
OPTIONS: tuple[str, ...] = ("width", "num_classes")
INPUT_SHAPE: tuple[int, int, int] = (3, 32, 32)
_ALIASES = {"classes": "num_classes"}


def _parse_value(text: str) -> Any:
    """Option value from text: int, then float, then true/false, else the string itself."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
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
            raise PrecsearchError(f"bad option {item!r} in model spec {spec!r}; write key=value,...")
        key = _ALIASES.get(key, key)
        if key in options:
            raise PrecsearchError(f"option {key!r} given twice in model spec {spec!r}; give it once")
        options[key] = _parse_value(value)
    return options


def parse_model_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split `name[:key=value,...]` or `package.module:factory[:key=value,...]` into (name, options).

    A zoo name has no dot; a factory path is `module:attribute`, where a module without a dot is
    accepted when it is not a zoo name and the part after the first colon is a name, not options.
    Numbers become int or float; `classes=` is read as `num_classes=`.
    """
    parts = spec.strip().split(":")
    head = parts[0].strip()
    if not head:
        raise PrecsearchError(f"empty model name in spec {spec!r}; give a zoo name ({', '.join(NAMES)}) "
                              "or package.module:factory")
    is_factory = "." in head or (head not in _ZOO and len(parts) > 1 and parts[1].strip().isidentifier())
    if is_factory:
        if len(parts) < 2 or not parts[1].strip().isidentifier() or len(parts) > 3:
            raise PrecsearchError(f"bad factory path {spec!r}; write package.module:factory[:key=value,...]")
        return f"{head}:{parts[1].strip()}", _parse_options(parts[2] if len(parts) == 3 else "", spec)
    if len(parts) > 2:
        raise PrecsearchError(f"bad model spec {spec!r}; write name[:key=value,...], e.g. resnet18:width=0.5")
    return head, _parse_options(parts[1] if len(parts) == 2 else "", spec)


def _is_number(value: Any) -> bool:
    """True for int and float, not bool (a bool is an int to Python, never a width or a class count)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_zoo_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Validate `width` (positive number) and `num_classes` (positive integer) for a zoo model."""
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
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = "" if "." in module_name else f" (or use a zoo model: {', '.join(NAMES)})"
        raise PrecsearchError(f"cannot import module {module_name!r} for model factory {path!r} ({exc}); "
                              f"install it or add its folder to PYTHONPATH{hint}") from exc
    factory = getattr(module, attribute, None)
    if factory is None:
        raise PrecsearchError(f"module {module_name!r} has no attribute {attribute!r} "
                              f"(model factory {path!r}); check the name after the colon")
    if not callable(factory):
        raise PrecsearchError(f"model factory {path!r} is a {type(factory).__name__}, not a callable")
    return factory


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


def build(name: str, **options: Any) -> nn.Module:
    """Build a zoo model or call a user factory; `name` may carry options (`resnet18:width=0.5`).

    Keyword options override those in `name`. Zoo options: `width` (channel multiplier, default 1.0)
    and `num_classes` (default 10; `classes` is accepted too). Initialization draws from torch's global
    RNG, so `torch.manual_seed(s)` before `build` makes it deterministic.
    """
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
        try:
            model = factory(**merged)
        except Exception as error:  # the user's code: its own line, not a traceback through ours
            raise user_code_error(f"model factory {model_name!r}", error) from error
        if not isinstance(model, nn.Module):
            raise PrecsearchError(f"model factory {model_name!r} returned {type(model).__name__}, "
                                  "expected a torch.nn.Module")
        return model
    if model_name not in _ZOO:
        close = difflib.get_close_matches(model_name, NAMES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise PrecsearchError(f"unknown model {model_name!r}{hint}; choose one of {', '.join(NAMES)} "
                              "or give a factory as package.module:function")
    return _ZOO[model_name](**_check_zoo_options(model_name, merged))
