"""Whether and how a policy's training step is compiled, as one value that travels with the rest of a run's
configuration (``apply_policy``, ``train``, a search's proxies and its worker processes): no environment
variable decides it. precsearch.runtime.compiled carries it out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_COMPILE", "CompileOptions", "CompiledGraphs"]


class CompiledGraphs:
    """What the runs sharing one ``CompileOptions`` have built: their compiled graphs (by model structure, sites
    and code widths, so that a search's trials share one) and the reasons already logged for training eagerly
    instead (one WARNING each). A copy for another process starts empty: compiled code does not travel."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[Any, ...], Any] = {}
        self.warned: set[tuple[str, str]] = set()  # (model, reason)

    def __reduce__(self) -> tuple[type, tuple]:
        return CompiledGraphs, ()


@dataclass(frozen=True)
class CompileOptions:
    r"""``backend``: torch.compile's backend (``"inductor"``; ``"aot_eager"`` runs the graph's own float32 ops,
    bit for bit as the eager runtime). ``saves_codes``: each rounded tensor autograd saves for the backward is
    held as its format's codes (1 byte up to 8 bits, 2 up to 16), as the eager runtime holds it, so compiled
    and eager training hold the same memory; the graph then depends on each tensor's code width, so an
    assignment of other widths (or a promotion that widens one) compiles again. False saves float32 (more
    memory than plain fp32) and serves every assignment of a model with one graph: what a search's proxies
    use, whose memory the cost model prices rather than measures. ``built``: the graphs these options have
    compiled, shared by every run given them and by options ``dataclasses.replace``\ d from them (not part of
    their value)."""

    backend: str = "inductor"
    saves_codes: bool = True
    built: CompiledGraphs = field(default_factory=CompiledGraphs, compare=False, repr=False)


DEFAULT_COMPILE = CompileOptions()  # ``apply_policy(..., compile=True)``: one process's calls share its graphs
