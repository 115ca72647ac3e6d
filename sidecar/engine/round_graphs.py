"""Decode rounds at fixed shapes, captured as CUDA graphs on CUDA devices (`compile: on`).

Why: on a GPU an eager decode round is launch-bound — hundreds of small kernels, each costing the
host more than the device — so a step took about as long at 0.6B parameters as at 8B
(BENCHMARKS.md, "The engine on a GPU"). A CUDA graph replays a whole phase with one launch, but
only a phase whose shapes and memory addresses never change: `FixedRounds` runs the round's phases
(`decode_round.draft_phase`, `verify_phase`) with device lengths at a fixed shape
(`attention_lengths.DeviceLengths`):

- rows padded to a batch bucket (`batch_bucket`: 1, 2, 4, 8, then multiples of 8, as SGLang's
  CUDA-graph runner pads); padded rows have length 0 and write only scratch slots of free cache
  rows; per-row sampling settings of padded rows copy row 0's;
- KV reads at bucketed widths (`read_bucket`: a power of two of at least `MIN_READ` slots);
- one graph a round, `draft_phase` then `verify_phase`, captured the first time its shape occurs
  (one warm-up run on a side stream, then the capture; both write the cache slots the replay
  writes, with the same values); where automatic k's controller times the draft phase, two graphs,
  one a phase, the verify graph reading the draft graph's outputs and inputs where they are (its
  key holds the draft graph's), so a round's inputs are copied once either way; outputs kept past
  the next replay are copied out of the shared memory pool;
- the host side a replay cannot do (committing row lengths) done here after the replays;
- a capture that fails (a kernel some torch version or device cannot capture) logs a warning once
  and the engine goes on without graphs: `compile: auto` never stops a sidecar that eager serves.

A graph reads the weights at the addresses it was captured with: `DecodeWeights.refresh` rewrites
the fused copies in place and pushes copy into the parameters, and `check_weights` drops every
graph when any weight's address changed anyway (a push that adopted new storage), so generation
after a push always computes with the pushed weights.

On a CPU the same fixed-shape rounds run eagerly (nothing to capture): that is how CI tests the
code a GPU captures (`tests/sidecar/engine/test_fixed_shape_forwards.py`). It is slower there than
`decode_round` at the batch's own shapes, so `compile: auto` keeps CPUs on the eager path.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from sidecar.engine.attention_lengths import DeviceLengths, FixedShape
from sidecar.engine.config import MIN_READ
from sidecar.engine.decode_round import EagerRounds, RoundInput, RoundOutput, draft_phase, verify_phase
from sidecar.engine.drafters import Drafter
from sidecar.engine.rows import BatchTensors
from sidecar.engine.sampling import AcceptanceRule
from sidecar.model.decode_kernels import DecodeKernels
from sidecar.model.kv_cache import KVCache, upload

log = logging.getLogger(__name__)


def batch_bucket(rows: int, max_batch_size: int) -> int:
    """The rows a fixed-shape round of `rows` live rows runs: 1, 2, 4, 8, then the next multiple
    of 8, never more than the cache's `max_batch_size`."""
    bucket = 1 << max(rows - 1, 0).bit_length() if rows <= 8 else -(-rows // 8) * 8
    return min(bucket, max_batch_size)


def read_bucket(needed: int, capacity: int) -> int:
    """The KV slots a fixed-shape forward reads when it needs `needed`: the next power of two of at
    least MIN_READ, never more than the cache's capacity."""
    return min(max(MIN_READ, 1 << max(needed - 1, 0).bit_length()), capacity)


@dataclass(slots=True)
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    sources: tuple[Tensor, ...] = ()
    """The tensors last copied into `inputs` (held, so no new tensor takes their identity): one that
    comes again is not copied again. Round inputs are never written in place once made."""


class FixedRounds:
    """Runs decode rounds at fixed shapes (see the module docstring); `capture`: as CUDA graphs
    (CUDA devices only), else eagerly."""

    def __init__(self, *, capture: bool, device: torch.device | None = None) -> None:
        self.capture = capture
        self.device = device
        """The CUDA device the graphs run on (captures and replays run with it current: a sidecar
        serving cuda:1 must not capture on cuda:0's streams)."""
        self._graphs: dict[tuple[object, ...], _Graph] = {}
        self._pool: Any = None  # one memory pool for all graphs (replays never overlap)
        self._signature: list[int] = []
        self._padded: tuple[BatchTensors, int, BatchTensors] | None = None  # (batch, rows, its padded form)
        self.captured = 0
        """Graphs captured so far (first occurrences of shapes, and recaptures after new weight storage)."""

    def run(
        self,
        drafter: Drafter,
        cache: KVCache,  # the target's (static)
        draft_caches: list[KVCache],
        batch: BatchTensors,
        inp: RoundInput,
        accept: AcceptanceRule,
        drafted: Callable[[], None] | None = None,  # called between the phases (the controller's clock)
    ) -> RoundOutput:
        """`decode_round` of the same inputs: on return the target cache holds each row's k + 1
        verified positions and each draft cache its refreshed ones (the engine rolls back)."""
        b, k = inp.last.shape[0], inp.round_k
        drafting = draft_caches if k > 0 else []
        shape = _shape(inp, cache, drafting)
        for c in [cache, *drafting]:  # slots past the rows' lengths read as zeros (`KVCache.scrub`)
            c.scrub()
        padded_batch = self._pad_batch(batch, shape.rows)
        records = (_pad_input(inp, shape.rows), _lengths(drafter, cache, drafting, inp, shape), padded_batch)
        rows = padded_batch.rows
        flags = (rows.any_greedy, rows.any_top_k, rows.any_top_p, rows.any_processed)
        draft_key = ("draft", drafter, shape, flags)  # objects, not ids: the dict holds them
        draft_inputs, slots = _leaves(records), _slots(records)  # a phase reads its tensors from its inputs only

        def draft_fn(*t: Tensor) -> tuple[Tensor, ...]:
            phase, lengths, padded = _with_leaves(slots, t)
            return draft_phase(drafter, draft_caches, padded, phase, lengths)

        def verify_fn(drafts: Tensor, q: Tensor, u: Tensor, *t: Tensor) -> tuple[Tensor, ...]:
            phase, lengths, padded = _with_leaves(slots, t)
            packed, states, routes = verify_phase(drafter, cache, padded, phase, lengths, accept, drafts, q, u)
            return (packed, states) if routes is None else (packed, states, routes)

        keep = (1, 2) if inp.record_routes else (1,)  # outputs copied out of the graphs' pool (routes too)
        if drafted is None:  # nothing times the draft phase: the whole round is one graph

            def round_fn(*t: Tensor) -> tuple[Tensor, ...]:
                return verify_fn(*draft_fn(*t), *t)

            packed, states, *routes = self._run(
                ("round", draft_key, accept, inp.record_routes), round_fn, draft_inputs, by_reference=(), keep=keep
            )
        else:  # two graphs, the controller's clock read between them
            drafts, q, u = self._run(draft_key, draft_fn, draft_inputs, by_reference=(), keep=())
            drafted()
            # the verify graph reads this round's inputs where the draft graph's replay copied them
            # (its key pins the draft graph): one copy of each input a round, not two
            shared = self._graphs[draft_key].inputs if self.capture and draft_key in self._graphs else draft_inputs
            packed, states, *routes = self._run(
                ("verify", draft_key, accept, inp.record_routes),
                verify_fn,
                (),
                by_reference=(drafts, q, u, *shared),
                keep=keep,
            )
        _commit(cache, drafting, inp, shape)
        recorded = routes[0] if routes else None  # (sparse layers, bucket rows, k + 1, top k)
        return RoundOutput(packed=packed[:b], hidden=states[:b], routes=None if recorded is None else recorded[:, :b])

    def check_weights(self, tensors: Iterable[Tensor]) -> None:
        """Drop every captured graph when a tensor the rounds read has moved since they were captured."""
        if not self.capture:
            return
        signature = [t.data_ptr() for t in tensors]
        if signature != self._signature:
            self._graphs.clear()
            self._signature = signature

    # ---- inputs --------------------------------------------------------------------------------
    def _pad_batch(self, batch: BatchTensors, rows: int) -> BatchTensors:
        """`batch` with rows up to `rows` copying row 0's settings (built once per batch and bucket)."""
        # held, not keyed by id(): a new batch may get a freed one's id (a stale max_new_tokens
        # then let rows run past their budget: found on a GPU run)
        if self._padded is not None and self._padded[0] is batch and self._padded[1] == rows:
            return self._padded[2]
        b = batch.keys.shape[0]
        index = torch.cat([torch.arange(b), torch.zeros(rows - b, dtype=torch.int64)]).to(batch.keys.device)
        padded = _with_leaves(batch, tuple(t.index_select(0, index) for t in _leaves(batch)), Tensor)
        self._padded = (batch, rows, padded)
        return padded

    # ---- capture and replay ----------------------------------------------------------------------
    def _run(
        self,
        key: tuple[object, ...],
        fn: Callable[..., tuple[Tensor, ...]],
        inputs: tuple[Tensor, ...],
        *,
        by_reference: tuple[Tensor, ...],
        keep: tuple[int, ...],
    ) -> tuple[Tensor, ...]:
        """`fn(*by_reference, *inputs)`, replayed from its graph when capturing. `by_reference`:
        inputs at fixed addresses (another graph's outputs; the key must pin them), used as they
        are. Outputs numbered in `keep` are copied out of the graphs' shared pool; the others are
        valid only until the next replay."""
        if not self.capture:
            return fn(*by_reference, *inputs)
        with torch.cuda.device(self.device):
            graph = self._graphs.get(key)
            if graph is None:
                try:
                    graph = self._graphs[key] = self._capture(fn, by_reference, inputs)
                    graph.sources = inputs
                    self.captured += 1
                except RuntimeError as e:  # a kernel this torch or device cannot capture
                    log.warning(
                        "CUDA graph capture failed, so this engine runs its rounds without graphs "
                        "(correct, slower; serve with --compile off to skip the attempt): %s",
                        e,
                    )
                    self.capture = False
                    self._graphs.clear()
                    return fn(*by_reference, *inputs)
            else:  # the batch's sampling settings and a plain round's refresh zeros come again unchanged
                seen = graph.sources
                for i, (dst, src) in enumerate(zip(graph.inputs, inputs, strict=True)):
                    if i >= len(seen) or seen[i] is not src:
                        dst.copy_(src, non_blocking=True)
                graph.sources = inputs
            graph.graph.replay()
            return tuple(t.clone() if i in keep else t for i, t in enumerate(graph.outputs))

    def _capture(
        self, fn: Callable[..., tuple[Tensor, ...]], by_reference: tuple[Tensor, ...], inputs: tuple[Tensor, ...]
    ) -> _Graph:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy initialisation (cuBLAS workspaces, ...) outside the capture
            fn(*by_reference, *static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a sidecar's other threads may use CUDA while this one captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = fn(*by_reference, *static)
        return _Graph(graph=graph, inputs=static, outputs=tuple(outputs))


def _shape(inp: RoundInput, cache: KVCache, draft_caches: list[KVCache]) -> FixedShape:
    """The fixed shape of a round: rows to their batch bucket, every read to its read bucket."""
    k, width = inp.round_k, max(inp.refresh_counts) if inp.round_k > 0 else 0
    read_draft = 0
    if draft_caches:
        read_draft = read_bucket(max(max(c.lengths) for c in draft_caches) + width + k, draft_caches[0].capacity)
    read_target = read_bucket(max(cache.lengths) + k + 1, cache.capacity)
    rows = batch_bucket(len(cache.lengths), cache.max_batch_size)
    return FixedShape(rows=rows, k=k, width=width, read_draft=read_draft, read_target=read_target)


def _lengths(
    drafter: Drafter, cache: KVCache, draft_caches: list[KVCache], inp: RoundInput, shape: FixedShape
) -> DeviceLengths:
    """The round's device row lengths: every host-known length in one upload (the target's,
    each draft cache's before and after its refresh), padded rows of length 0."""
    pad = [0] * (shape.rows - len(cache.lengths))
    refreshed = [[n + r for n, r in zip(c.lengths, inp.refresh_counts, strict=True)] for c in draft_caches]
    lengths = upload(
        [n for row in [cache.lengths, *(c.lengths for c in draft_caches), *refreshed] for n in [*row, *pad]],
        inp.last.device,
    ).view(-1, shape.rows)
    # the fused attention needs no mask; it rotates whole heads, so a partial-rotary model (GLM-4.5)
    # attends through torch's operators, masked, while its other fused kernels still run
    fused = isinstance(drafter.model.kernels, DecodeKernels) and drafter.model.config.partial_rotary_factor == 1.0
    layers = len(draft_caches)
    return DeviceLengths(
        target=lengths[0],
        drafts=lengths[1 : 1 + layers],
        confirmed=lengths[1 + layers :],
        shape=shape,
        masked_draft=not (fused and drafter.kind == "mtp"),  # MTP layers are decoder layers
        masked_target=not fused,
    )


def _commit(cache: KVCache, draft_caches: list[KVCache], inp: RoundInput, shape: FixedShape) -> None:
    """The host side a replay cannot do: what it wrote (k + 1 verified columns a row, padded rows
    from slot 0; the draft refresh's `width` columns, then up to k chain entries past the refreshed
    positions), and the row lengths it leaves."""
    pad, k = [0] * (shape.rows - len(cache.lengths)), inp.round_k
    cache.mark_written([n + k + 1 for n in [*cache.lengths, *pad]])
    for c in draft_caches:
        written = zip([*c.lengths, *pad], [*inp.refresh_counts, *pad], strict=True)
        c.mark_written([n + max(shape.width, r + k) for n, r in written])
    cache.commit_counts(inp.num_new)
    for c in draft_caches:
        c.commit_counts(inp.refresh_counts)


def _leaves(x: object) -> tuple[Tensor, ...]:
    """A round's inputs (records, tuples of them) as a graph's flat tensors, in field order; None
    fields (a plain round's refresh inputs) are not inputs."""
    if isinstance(x, Tensor):
        return (x,)
    if isinstance(x, tuple):
        return tuple(t for item in x for t in _leaves(item))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return tuple(t for f in fields(x) for t in _leaves(getattr(x, f.name)))
    return ()


class _Slot:
    """Where a graph input goes in `_slots`' records."""


def _slots(x: Any) -> Any:
    """`x` with each tensor `_leaves` lists replaced by a `_Slot`: what a phase's function holds,
    so that tracing it reads (and guards on) the inputs it is given, never a round's tensors."""
    return _with_leaves(x, tuple(_Slot() for _ in _leaves(x)), Tensor)


def _with_leaves(like: Any, t: tuple[Any, ...], slot: type = _Slot) -> Any:
    """`like` with its `slot`s taken from `t` in `_leaves`' order; everything else kept."""
    it = iter(t)

    def rebuilt(x: Any) -> Any:
        if isinstance(x, slot):
            return next(it)
        if isinstance(x, tuple):
            return tuple(rebuilt(item) for item in x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            changes = {f.name: rebuilt(getattr(x, f.name)) for f in fields(x) if f.init}
            return dataclasses.replace(x, **changes)
        return x

    return rebuilt(like)


def _pad_input(inp: RoundInput, rows: int) -> RoundInput:
    """`inp` with every tensor's rows up to `rows` (padded rows: zeros), for the device side: its
    host mirrors (which change every round, and no fixed-shape phase reads) left empty."""
    padded: dict[str, Any] = {}
    for f in fields(inp):
        if isinstance(value := getattr(inp, f.name), Tensor):
            padded[f.name] = _pad_rows(value, rows)
    return dataclasses.replace(inp, **padded, num_new=[], refresh_counts=[])


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    """`t` (B, ...) with rows B..rows-1 added as zeros."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def make_rounds(mode: str, device: torch.device) -> FixedRounds | EagerRounds:
    """The rounds of `compile` mode "on" (fixed shapes; CUDA graphs on CUDA), or `decode_round`
    eagerly at the batch's own shapes for "off", and for "auto" off CUDA (on a CPU the fixed shapes
    only add work)."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return EagerRounds()
    return FixedRounds(capture=device.type == "cuda", device=device if device.type == "cuda" else None)
