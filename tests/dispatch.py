"""A count of the ops the dispatcher runs (a ``TorchDispatchMode``: the dispatcher's own view, independent of
precsearch), for tests that count work rather than time it."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class DispatchCounter(TorchDispatchMode):
    """Every op the dispatcher runs, by name, and the host reads among them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops[str(func.overloadpacket)] += 1
        name = str(func.overloadpacket)
        if name in ("aten._to_copy", "aten.copy_") and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            sources = [a for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu"]
            if sources:
                self.ops["host copy"] += 1
        return out
