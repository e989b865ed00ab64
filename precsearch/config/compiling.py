"""Whether and how a policy's training step is compiled, as one value that travels with the rest of a run's
configuration (``apply_policy``, ``train``, a search's proxies and its worker processes): no environment
variable decides it. precsearch.runtime.compiled carries it out; the graphs it compiles belong to the runtime
a run is handed (precsearch.formats.runner.Runtime), not to this value."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CompileOptions"]


@dataclass(frozen=True)
class CompileOptions:
    """``backend``: torch.compile's backend (``"inductor"``; ``"aot_eager"`` runs the graph's own float32 ops,
    bit for bit as the eager runtime). ``saves_codes``: each rounded tensor autograd saves for the backward is
    held as its format's codes (1 byte up to 8 bits, 2 up to 16), as the eager runtime holds it, so compiled
    and eager training hold the same memory; the graph then depends on each tensor's code width, so an
    assignment of other widths (or a promotion that widens one) compiles again. False saves float32 (more
    memory than plain fp32) and serves every assignment of a model with one graph: what a search's proxies
    use, whose memory the cost model prices rather than measures."""

    backend: str = "inductor"
    saves_codes: bool = True
