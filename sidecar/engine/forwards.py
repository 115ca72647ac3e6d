"""How a decode round runs its cached forwards: eagerly at the batch's own shapes, or at fixed
shapes that a CUDA graph captures once and replays.

Why: on a GPU an eager decode step is launch-bound — a few hundred small kernels, each costing
the host more than the device — so a step takes about as long at 0.6B as at 8B parameters
(BENCHMARKS.md, "The engine on a GPU"). A CUDA graph replays the whole forward with one launch,
but only a forward whose shapes and memory addresses never change. `FixedShapeForwards` makes
every cached forward of a round (the target's verify, each draft step) such a forward:

- rows padded to a batch bucket (`batch_bucket`: 1, 2, 4, 8, then multiples of 8, as SGLang's
  CUDA-graph runner pads), the padded rows writing only scratch slots of free cache rows;
- each row's KV read over a bucketed width (`read_bucket`: a power of two, at least
  `MIN_READ`) under an additive mask built on the device from a device tensor of row lengths
  (`KVCache.plan_fixed`); writes by device index;
- inputs copied into the graph's own input tensors, outputs cloned out of its pool.

One graph per (forward, rows, columns, read width), captured the first time that shape occurs
(one warm-up run on a side stream, then the capture; both write the same cache slots the replay
writes, with the same values). A graph reads the weights at the addresses it was captured with:
`DecodeWeights.refresh` rewrites the fused copies in place, weight pushes copy into parameters,
and `check_weights` drops every graph when any weight's address changed anyway (a push that
adopted new storage), so a push followed by generation always computes with the pushed weights.

On a CPU the same fixed-shape forwards run eagerly (there is nothing to capture): that is how CI
tests the code a GPU captures (`tests/engine/test_fixed_shape_forwards.py`), and it is slower than
`Forwards` there, so `compile: auto` keeps CPUs on the eager path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sidecar.engine.drafters import Drafter
from sidecar.model.kv_cache import KVCache

MIN_READ = 256
"""Smallest KV read width of a fixed-shape forward (slots): contexts up to it share one graph."""


def batch_bucket(rows: int, max_batch: int) -> int:
    """The rows a fixed-shape forward of `rows` live rows runs: 1, 2, 4, 8, then the next multiple
    of 8, never more than the cache's `max_batch`."""
    bucket = 1 << max(rows - 1, 0).bit_length() if rows <= 8 else -(-rows // 8) * 8
    return min(bucket, max_batch)


def read_bucket(needed: int, capacity: int) -> int:
    """The KV slots a fixed-shape forward reads when it needs `needed`: the next power of two of at
    least MIN_READ, never more than the cache's capacity."""
    return min(max(MIN_READ, 1 << max(needed - 1, 0).bit_length()), capacity)


class Forwards:
    """The round's cached forwards, eagerly at the batch's own shapes: the reference path."""

    captured = 0

    def target(
        self,
        drafter: Drafter,
        cache: KVCache,  # the target's; on return each row holds its num_new new positions
        tokens: Tensor,  # (B, S), row b's first num_new[b] columns valid
        num_new: list[int],
    ) -> tuple[Tensor, Tensor, Tensor]:  # hidden (B, S, h), draft inputs (B, S, dh), logits (B, S, V) float32
        plan = cache.plan(num_new, width=tokens.shape[1])
        hidden, states = drafter.target_step(tokens, cache, plan)
        cache.commit(plan)
        return hidden, states, drafter.model.logits(hidden).float()

    def draft(
        self,
        drafter: Drafter,
        j: int,  # the draft layer
        cache: KVCache,  # its cache; on return each row holds its num_new new positions
        tokens: Tensor,  # (B, S)
        states: Tensor,  # (B, S, dh)
        num_new: list[int],
        rope_positions: Tensor,  # (B, S) int64
    ) -> Tensor:  # (B, S, dh) the layer's pre-norm outputs
        plan = cache.plan(num_new, width=tokens.shape[1])
        out = drafter.step(j, tokens, states, cache, plan, rope_positions)
        cache.commit(plan)
        return out

    def check_weights(self, tensors: Iterable[Tensor]) -> None:
        """Called once per round with every tensor the forwards read: nothing to do eagerly."""


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


class FixedShapeForwards(Forwards):
    """The same forwards at fixed shapes (see the module docstring); `capture`: as CUDA graphs
    (CUDA devices only), else run eagerly."""

    def __init__(self, *, capture: bool) -> None:
        self.capture = capture
        self._graphs: dict[tuple[object, ...], _Graph] = {}
        self._pool: Any = None  # one memory pool for all graphs (replays never overlap)
        self._signature: list[int] = []
        self.captured = 0
        """Graphs captured so far (each a first occurrence of a shape, or a recapture after new weight storage)."""

    def target(
        self, drafter: Drafter, cache: KVCache, tokens: Tensor, num_new: list[int]
    ) -> tuple[Tensor, Tensor, Tensor]:
        b, s = tokens.shape
        rows = batch_bucket(b, cache.max_batch)
        read = read_bucket(max(cache.lengths) + s, cache.capacity)

        def forward(tokens: Tensor, lengths: Tensor) -> tuple[Tensor, ...]:
            plan = cache.plan_fixed(lengths, s, read)
            hidden, states = drafter.target_step(tokens, cache, plan)
            return hidden, states, drafter.model.logits(hidden).float()

        out = self._run(
            ("target", id(cache), rows, s, read),
            forward,
            _pad_rows(tokens, rows),
            self._lengths(cache, rows),
            borrowed=1,  # the logits are read within the round, before any other replay
        )
        cache.commit_counts(num_new)
        hidden, states, logits = (t[:b] for t in out)
        return hidden, states, logits

    def draft(
        self,
        drafter: Drafter,
        j: int,
        cache: KVCache,
        tokens: Tensor,
        states: Tensor,
        num_new: list[int],
        rope_positions: Tensor,
    ) -> Tensor:
        b, s = tokens.shape
        rows = batch_bucket(b, cache.max_batch)
        read = read_bucket(max(cache.lengths) + s, cache.capacity)

        def forward(tokens: Tensor, states: Tensor, rope_positions: Tensor, lengths: Tensor) -> tuple[Tensor, ...]:
            plan = cache.plan_fixed(lengths, s, read)
            return (drafter.step(j, tokens, states, cache, plan, rope_positions),)

        (out,) = self._run(
            ("draft", j, id(cache), rows, s, read),
            forward,
            _pad_rows(tokens, rows),
            _pad_rows(states, rows),
            _pad_rows(rope_positions, rows),
            self._lengths(cache, rows),
        )
        cache.commit_counts(num_new)
        return out[:b]

    def check_weights(self, tensors: Iterable[Tensor]) -> None:
        """Drop every captured graph when a tensor the forwards read has moved since they were captured."""
        if not self.capture:
            return
        signature = [t.data_ptr() for t in tensors]
        if signature != self._signature:
            self._graphs.clear()
            self._signature = signature

    @staticmethod
    def _lengths(cache: KVCache, rows: int) -> Tensor:
        lengths = cache.lengths + [0] * (rows - cache.batch)
        return torch.tensor(lengths, dtype=torch.int64).to(cache.device, non_blocking=True)

    def _run(
        self,
        key: tuple[object, ...],
        forward: Callable[..., tuple[Tensor, ...]],
        *inputs: Tensor,
        borrowed: int = 0,
    ) -> tuple[Tensor, ...]:
        """`forward(*inputs)`, replayed from its graph when capturing. Outputs are copied out of
        the graphs' shared memory pool (the next replay of any graph may overwrite it), except the
        last `borrowed` ones: those stay valid only until the next replay."""
        if not self.capture:
            return forward(*inputs)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(forward, inputs)
        else:
            for dst, src in zip(graph.inputs, inputs, strict=True):
                dst.copy_(src, non_blocking=True)
        graph.graph.replay()
        n = len(graph.outputs) - borrowed
        copies: dict[int, Tensor] = {}  # an output returned twice (MTP: hidden = draft inputs) is copied once
        for t in graph.outputs[:n]:
            if id(t) not in copies:
                copies[id(t)] = t.clone()
        return tuple(copies[id(t)] for t in graph.outputs[:n]) + graph.outputs[n:]

    def _capture(self, forward: Callable[..., tuple[Tensor, ...]], inputs: tuple[Tensor, ...]) -> _Graph:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy initialisation (cuBLAS workspaces, ...) outside the capture
            forward(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a sidecar's other threads may use CUDA while this one captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = forward(*static)
        self.captured += 1
        return _Graph(graph=graph, inputs=static, outputs=outputs)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    """`t` (B, ...) with rows B..rows-1 added as zeros."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def make_forwards(mode: str, device: torch.device) -> Forwards:
    """The forwards of `compile` mode "off" (eager), "on" (fixed shapes; CUDA graphs on CUDA) or
    "auto" (on for CUDA devices, off elsewhere: on a CPU the fixed shapes only add work)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"compile must be auto, on or off, got {mode!r}")
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return Forwards()
    return FixedShapeForwards(capture=device.type == "cuda")
