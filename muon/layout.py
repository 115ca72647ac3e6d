"""Row layouts of fused weight matrices, so Muon orthogonalises each logical matrix on its own.

Megatron-core fuses several logical matrices into one weight:

* ``linear_qkv.weight`` (column-parallel) is grouped per query group: for each of the
  ``num_query_groups`` groups, ``heads_per_group·head_dim`` query rows, then ``head_dim`` key rows,
  then ``head_dim`` value rows (megatron/core/transformer/attention.py splits the projection output
  exactly this way). Tensor parallelism gives each rank whole query groups.
* ``linear_fc1.weight`` of a SwiGLU MLP stacks the gate rows over the up rows. Tensor parallelism
  shards gate and up *separately*: each rank holds ``[gate_shard; up_shard]`` (partition stride 2).

Orthogonalising the fused matrix as a whole would couple Q with K and V (and gate with up), whose
scales and roles differ; the reference RL system orthogonalises Q, K and V separately. Two
granularities are offered:

* ``per_group`` (default): every query group's Q block, K block and V block is its own matrix (a
  batch of ``num_query_groups`` independent matrices per kind), following the fused layout
  literally;
* ``per_kind``: one Q matrix (all groups' query rows), one K and one V matrix — what
  megatron-core 0.16's own ``TensorParallelMuon`` (``muon_split_qkv``) does, and the same as
  Muon on separate Hugging Face ``q_proj``/``k_proj``/``v_proj`` weights.

A :class:`RowBlocks` describes such a layout in *global* (unsharded) row order; ``tp_stride`` says
how tensor parallelism interleaves it (see ``muon.tensor_parallel``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

QKV_SPLIT_MODES = ("per_group", "per_kind")


@dataclass(frozen=True, slots=True, kw_only=True)
class RowBlocks:
    """Rows of a fused matrix: ``groups`` repetitions of consecutive blocks of ``sizes`` rows.

    Block kind i of every group is orthogonalised as its own (sizes[i], cols) matrix, or, with
    ``merge_groups``, all groups' blocks of kind i together as one (groups·sizes[i], cols) matrix.
    """

    sizes: tuple[int, ...]
    """Rows of each block kind within one group, in storage order (e.g. (q, k, v))."""
    groups: int = 1
    """How many times the block pattern repeats down the rows (query groups for QKV)."""
    tp_stride: int = 1
    """How tensor parallelism shards these rows: 1 = each rank holds whole consecutive groups
    (QKV); ``len(sizes)`` = every block kind is sharded on its own and each rank stores its pieces
    stacked (SwiGLU fc1, Megatron ``partition_stride=2``)."""
    merge_groups: bool = False
    """Orthogonalise each block kind across all groups as one matrix (``per_kind`` QKV)."""

    def __post_init__(self) -> None:
        if not self.sizes or any(s < 1 for s in self.sizes):
            raise ValueError(f"RowBlocks.sizes={self.sizes!r} must be non-empty positive row counts")
        if self.groups < 1:
            raise ValueError(f"RowBlocks.groups={self.groups!r} must be >= 1")
        if self.tp_stride not in (1, len(self.sizes)):
            raise ValueError(f"RowBlocks.tp_stride={self.tp_stride!r} must be 1 or len(sizes)={len(self.sizes)}")

    @property
    def rows(self) -> int:
        return self.groups * sum(self.sizes)

    def split(
        self, full: Tensor
    ) -> list[Tensor]:  # (rows, cols) -> [(groups, sizes[i], cols)] or [(1, groups·sizes[i], cols)]
        """The matrices to orthogonalise: per block kind, a batch of per-group blocks (or one merged matrix)."""
        if full.ndim != 2 or full.size(0) != self.rows:
            raise ValueError(f"RowBlocks expects a ({self.rows}, cols) matrix, got {tuple(full.shape)}")
        cols = full.size(1)
        parts = torch.split(full.reshape(self.groups, sum(self.sizes), cols), list(self.sizes), dim=1)
        if self.merge_groups:
            return [part.reshape(1, -1, cols) for part in parts]
        return list(parts)

    def merge(self, blocks: list[Tensor]) -> Tensor:  # inverse of split -> (rows, cols)
        """Inverse of :meth:`split`."""
        cols = blocks[0].size(-1)
        grouped = torch.cat(
            [b.reshape(self.groups, size, cols) for b, size in zip(blocks, self.sizes, strict=True)], dim=1
        )
        return grouped.reshape(self.rows, cols)


@dataclass(frozen=True, slots=True, kw_only=True)
class QKVLayout:
    """Shape of Megatron's fused ``linear_qkv`` (grouped-query attention)."""

    num_query_groups: int
    """Key/value heads (Megatron ``num_query_groups``, Hugging Face ``num_key_value_heads``)."""
    heads_per_group: int
    """Query heads per key/value head (num_attention_heads // num_query_groups)."""
    head_dim: int
    """Channels per head (Megatron ``kv_channels``)."""

    def __post_init__(self) -> None:
        for field in ("num_query_groups", "heads_per_group", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"QKVLayout.{field}={value!r} must be a positive integer")

    @classmethod
    def from_heads(cls, *, num_attention_heads: int, num_query_groups: int, head_dim: int) -> QKVLayout:
        """Build from the usual model-config numbers (checks that heads divide into groups)."""
        if num_query_groups < 1 or num_attention_heads % num_query_groups:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} must be a multiple of num_query_groups={num_query_groups}"
            )
        return cls(
            num_query_groups=num_query_groups,
            heads_per_group=num_attention_heads // num_query_groups,
            head_dim=head_dim,
        )

    def row_blocks(self, mode: str = "per_group") -> RowBlocks:
        """Q, K and V blocks per query group (``per_group``) or across groups (``per_kind``).

        Tensor parallelism keeps whole query groups per rank either way (stride 1).
        """
        if mode not in QKV_SPLIT_MODES:
            raise ValueError(f"QKV split mode={mode!r} is unknown; choose one of {QKV_SPLIT_MODES}")
        q = self.heads_per_group * self.head_dim
        return RowBlocks(
            sizes=(q, self.head_dim, self.head_dim),
            groups=self.num_query_groups,
            tp_stride=1,
            merge_groups=mode == "per_kind",
        )


def gated_fc1_blocks(rows: int) -> RowBlocks:
    """SwiGLU ``linear_fc1``: gate rows over up rows, each sharded on its own under TP."""
    if rows % 2:
        raise ValueError(f"a gated fc1 weight needs an even number of rows (gate over up), got {rows}")
    return RowBlocks(sizes=(rows // 2, rows // 2), groups=1, tp_stride=2)
