"""The decode round at fixed shapes: the device work a CUDA graph captures once and replays.

`decode_round` runs a round at the batch's own shapes: the KV read width follows the longest row,
the row lengths that place each write are host ints, and drafting commits and rolls back lengths
on the host between forwards. A CUDA graph replays kernels with the shapes and addresses it was
captured with, and nothing on the host runs during a replay. So here the same round is written
for a fixed shape (`FixedShape`: rows padded to a bucket, the drafts' and the target's KV read at
bucketed widths, a fixed draft length and refresh width) with every per-row quantity a device
tensor (`FixedInput`): each forward's slots come from device row lengths (`KVCache.plan_fixed`),
the draft chain's positions are those lengths plus Python constants, and nothing is read back.

It is two phases: `draft_phase` (the round's uniforms, the draft refresh and chain) and
`verify_phase` (the target forward over the k + 1 columns, acceptance, the packed result,
`decode_round.accept_round`), captured as one graph, or as one graph each where the speculation
controller times the draft phase.
`round_graphs.FixedRounds` builds the inputs, pads the rows, captures and replays, and applies the
host side (row lengths) the replays cannot.

The arithmetic is `decode_round`'s, row by row: padded rows and wider reads add masked slots and
rows no live row depends on. Tests: `tests/engine/test_fixed_shape_forwards.py` (CPU, eager),
`tests/engine/test_cuda_graphs.py` (captured, on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sidecar.engine.decode_round import accept_round
from sidecar.engine.drafters import Drafter
from sidecar.engine.rows import BatchTensors
from sidecar.engine.sampling import AcceptanceRule, filtered_probs, sample_from
from sidecar.model.decode_kernels import DecodeKernels
from sidecar.model.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class FixedShape:
    """The host ints that fix a round's shapes (part of its graphs' keys)."""

    rows: int
    """Rows of every tensor (the live rows, then padding)."""
    k: int
    """Drafts per row (rows drafting fewer mask the rest)."""
    width: int
    """Refresh columns (0 when k = 0)."""
    read_draft: int
    """KV slots each draft forward reads (0 when k = 0)."""
    read_target: int
    """KV slots the verify forward reads."""


@dataclass(kw_only=True, slots=True)
class FixedInput:
    """A round's per-row inputs, (rows,) int64 unless said otherwise."""

    out_len: Tensor
    last: Tensor
    num_draft: Tensor
    next_position: Tensor
    target_lengths: Tensor
    """The target cache's row lengths (0 on padded rows)."""
    draft_lengths: Tensor
    """(draft layers, rows) each draft cache's row lengths."""
    num_refresh: Tensor
    """Pending draft inputs per row (0 on rows that do not draft)."""
    refresh_tokens: Tensor
    """(rows, width) the draft inputs' tokens x_{t+1}, right-padded."""
    refresh_hidden: Tensor
    """(rows, width, draft hidden) the pending states."""
    refresh_positions: Tensor
    """(rows, width) their draft positions t."""


def draft_phase(
    drafter: Drafter,
    caches: list[KVCache],  # one per draft layer (static)
    batch: BatchTensors,  # `shape.rows` rows
    inp: FixedInput,
    shape: FixedShape,
) -> tuple[Tensor, Tensor, Tensor]:  # drafts (R, k) int64, their distributions q (R, k, V), uniforms (R, 2k + 1)
    """The round's uniforms and the draft chain (`speculative.draft` at fixed shapes). The draft
    caches get the refreshed positions and scratch chain entries; their host lengths are the
    caller's to commit (+ num_refresh)."""
    kernels = drafter.model.kernels
    fused = isinstance(kernels, DecodeKernels)
    if isinstance(kernels, DecodeKernels):  # one kernel for the ~35 operators of the hash, bit for bit
        u = kernels.round_uniforms(batch.keys, inp.out_len, shape.k)
    else:
        u = batch.round_uniforms(inp.out_len, shape.k)
    r, k, vocab = shape.rows, shape.k, drafter.model.config.vocab_size
    masked = not (fused and drafter.kind == "mtp")  # MTP layers are decoder layers: fused attention, no mask
    if k == 0:
        return inp.last.new_zeros(r, 0), torch.zeros(r, 0, vocab, device=u.device), u
    out0: Tensor | None = None
    for j, cache in enumerate(caches):
        plan = cache.plan_fixed(inp.draft_lengths[j], shape.width, shape.read_draft, masked=masked)
        out = drafter.step(j, inp.refresh_tokens, inp.refresh_hidden, cache, plan, inp.refresh_positions + 1)
        out0 = out if j == 0 else out0
    assert out0 is not None
    confirmed = inp.draft_lengths + inp.num_refresh  # (L, R): each cache's rows after the refresh
    last = (inp.num_refresh - 1).clamp(min=0)
    g = out0[torch.arange(r, device=u.device), last]  # (R, draft hidden) the output at t = n - 2
    q = filtered_probs(drafter.head(0, g), batch.rows)
    token = sample_from(q, u[:, 0])
    tokens, probs = [token], [q]
    chained = [0] * len(caches)  # chain entries written to each layer so far
    for d in range(1, k):
        j = min(d, len(caches) - 1)
        plan = caches[j].plan_fixed(confirmed[j] + chained[j], 1, shape.read_draft, masked=masked)
        chained[j] += 1
        rope = (inp.next_position + d)[:, None]
        g = drafter.step(j, token[:, None], g[:, None], caches[j], plan, rope)[:, 0]
        q = filtered_probs(drafter.head(j, g), batch.rows)
        token = sample_from(q, u[:, d])
        tokens.append(token)
        probs.append(q)
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1), u


def verify_phase(
    drafter: Drafter,
    cache: KVCache,  # the target's (static)
    batch: BatchTensors,
    inp: FixedInput,
    shape: FixedShape,
    accept: AcceptanceRule,
    drafts: Tensor,  # (R, k)
    q: Tensor,  # (R, k, V)
    u: Tensor,  # (R, 2k + 1)
) -> tuple[Tensor, Tensor]:  # packed (R, 2(k + 1) + 3) float64, draft inputs at the verified positions (R, k + 1, dh)
    """The target forward over each row's last token and its drafts, then acceptance (the
    target cache's host lengths are the caller's to commit)."""
    tokens = torch.cat([inp.last[:, None], drafts], dim=1)
    masked = not isinstance(drafter.model.kernels, DecodeKernels)  # the fused attention needs no mask
    plan = cache.plan_fixed(inp.target_lengths, shape.k + 1, shape.read_target, masked=masked)
    hidden, states = drafter.target_step(tokens, cache, plan)
    logits = drafter.model.logits(hidden).float()
    probs = filtered_probs(logits, batch.rows)
    packed = accept_round(batch, accept, drafts, q, logits, probs, inp.num_draft, inp.out_len, u)
    return packed, states
