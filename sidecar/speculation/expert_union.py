"""What a forward of a mixture-of-experts model reads: the union of the experts its tokens route to.

Why: a decode step at small batch reads its weights; a dense model's verify of k + 1 tokens reads
the same bytes as a plain step, but an MoE's reads every expert any of its B·(k + 1) tokens routes
to. Under uniform routing, with E experts and top-k routing, T tokens touch

    U(T) = E · (1 − (1 − k/E)^T)

experts per sparse layer (Qwen3-30B-A3B, E = 128, k = 8: U(1) = 8, U(4) ≈ 29, U(16) ≈ 110, U(64) ≈
128): a k = 3 verify at batch 1 reads ~3.6× the expert bytes of a plain step, at batch 16 ~1.2×, at
64 ~1×. Consecutive tokens share experts more than uniformly (Cohere measured ~2.5× for 4 tokens),
so where the engine measured its own routes the measured union replaces the formula
(`ExpertReads.measured`).

`ExpertReads` turns that into a step's bytes, and the ratio a verify of width w costs over a plain
step at batch B, which the automatic-k controller uses as its prior before it has measured a width
(`SpeculationController`; the dense prior is a flat slope) and `specrl plan` uses for its roofline
(`trainer.planning.shapes.ModelShape.weight_bytes`): one formula for both.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


def uniform_union(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts of one sparse layer that `tokens` tokens route to, uniform routing."""
    if experts <= 0 or tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


@dataclass(frozen=True, slots=True)
class ExpertReads:
    """The bytes one forward reads, split into what every forward reads (attention, dense layers,
    shared experts, routers, the output head) and the routed experts it touches."""

    experts: int
    """Routed experts per sparse layer, E."""
    top_k: int
    """Experts each token is routed to."""
    sparse_layers: int
    """Layers with routed experts."""
    expert_bytes: float
    """Bytes of one expert's weights."""
    fixed_bytes: float
    """Bytes every forward reads whatever its tokens."""
    measured: Callable[[float], float] | None = None
    """Distinct experts per sparse layer for a number of tokens, from the engine's own routes
    (None: `uniform_union`)."""

    def union(self, tokens: float) -> float:
        """Distinct experts per sparse layer `tokens` tokens read."""
        if self.measured is not None:
            return min(float(self.experts), self.measured(tokens))
        return uniform_union(self.experts, self.top_k, tokens)

    def step_bytes(self, tokens: float) -> float:
        """Bytes a forward over `tokens` tokens (a batch's rows times its width) reads."""
        return self.fixed_bytes + self.sparse_layers * self.union(tokens) * self.expert_bytes

    def verify_ratio(self, batch: int, width: int) -> float:
        """A width-`width` verify's bytes over a plain step's at `batch` rows (>= 1)."""
        return self.step_bytes(batch * width) / self.step_bytes(batch)


class MeasuredUnion:
    """Distinct experts per sparse layer by the tokens of a forward, as the engine measured them in
    its verify passes (`observe`: the routes of every verified column, accepted or not: the verify
    read them all). A token count measured: the mean of its latest `window` readings. One not
    measured: the uniform formula times the measured / uniform ratio at the nearest measured count
    (in log tokens; consecutive tokens share experts alike at neighbouring widths), within what
    any T tokens read (top k to min(E, T x top k): one token reads exactly top k). Nothing
    measured: the uniform formula. Callable as `ExpertReads.measured`."""

    def __init__(self, experts: int, top_k: int, window: int = 64) -> None:
        self.experts, self.top_k, self.window = experts, top_k, window
        self._readings: dict[int, deque[float]] = {}

    def observe(self, tokens: int, distinct: float) -> None:
        """One forward of `tokens` tokens read `distinct` experts per sparse layer (the layers' mean)."""
        if tokens <= 0 or not 0.0 < distinct <= self.experts:
            raise ValueError(f"a forward of {tokens} tokens cannot read {distinct} of {self.experts} experts")
        self._readings.setdefault(tokens, deque(maxlen=self.window)).append(distinct)

    @property
    def measured_tokens(self) -> list[int]:
        """The token counts measured so far."""
        return sorted(self._readings)

    def __call__(self, tokens: float) -> float:
        uniform = uniform_union(self.experts, self.top_k, tokens)
        if not self._readings or tokens <= 0:
            return uniform
        nearest = min(self._readings, key=lambda t: (abs(math.log(t / tokens)), t))
        readings = self._readings[nearest]
        mean = sum(readings) / len(readings)
        if nearest != tokens:
            mean = uniform * mean / uniform_union(self.experts, self.top_k, nearest)
        # what any T >= 1 tokens read: at least one token's top k, at most T x top k and E (one token: top k)
        return min(max(mean, float(self.top_k)), float(self.experts), max(tokens, 1.0) * self.top_k)
