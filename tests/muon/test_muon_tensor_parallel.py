"""Tensor-parallel Muon: two gloo processes must produce exactly the single-process update.

Each worker holds megatron-core style shards (the attributes ``tensor_model_parallel``,
``partition_dim``, ``partition_stride`` that ``set_tensor_model_parallel_attributes`` sets) of a
small layer: a column-parallel fused QKV (whole query groups per rank), a column-parallel SwiGLU
fc1 (each rank ``[gate_shard; up_shard]``, split and unsplit), a row-parallel projection, a
vocab-parallel embedding and a replicated norm. The oracle is the same optimizer run on the full,
unsharded tensors with no process group, sharded afterwards by the explicit slicing below.

Why bitwise: the all-gather is a copy, so every rank orthogonalises the very matrix the single
process does, with the same shapes and the same kernels (one thread everywhere); momentum, weight
decay and AdamW are elementwise. The gradient norm is the exception (a sum over differently
partitioned terms), so clipping is compared within float32 round-off instead.

The shard arithmetic and gathers are `muon/tensor_parallel.py`'s.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from muon import HybridOptimizerConfig, NewtonSchulzConfig, QKVLayout, build_optimizer
from tests.spawn_workers import join_group, leave_group, spawn

WORLD = 2
LAYOUT = QKVLayout(num_query_groups=4, heads_per_group=2, head_dim=4)  # 4 groups x (8 q + 4 k + 4 v) rows
HIDDEN, FFN, VOCAB, STEPS = 32, 24, 40, 3

# name -> (global shape, partition_dim or None for replicated, partition_stride)
PARAMS: dict[str, tuple[tuple[int, ...], int | None, int]] = {
    "embedding.word_embeddings.weight": ((VOCAB, HIDDEN), 0, 1),
    "decoder.layers.0.self_attention.linear_qkv.weight": ((64, HIDDEN), 0, 1),
    "decoder.layers.1.self_attention.linear_qkv.weight": ((64, HIDDEN), 0, 1),
    "decoder.layers.0.self_attention.linear_proj.weight": ((HIDDEN, 32), 1, 1),
    "decoder.layers.0.mlp.linear_fc1.weight": ((2 * FFN, HIDDEN), 0, 2),
    "decoder.layers.1.mlp.linear_fc1.weight": ((2 * FFN, HIDDEN), 0, 2),
    "decoder.layers.0.mlp.linear_fc2.weight": ((HIDDEN, FFN), 1, 1),
    "decoder.final_layernorm.weight": ((HIDDEN,), None, 1),
}


def shard(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """Megatron's layout of ``full`` on TP rank ``rank``, written out by hand (the oracle's slicing)."""
    _, dim, stride = PARAMS[name]
    if dim is None:
        return full.clone()
    if stride == 2:  # SwiGLU fc1: this rank's slice of gate, then its slice of up
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(WORLD, dim=0)[rank], up.chunk(WORLD, dim=0)[rank]]).clone()
    return full.chunk(WORLD, dim=dim)[rank].clone()


def full_tensors(seed: int) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    init = {name: torch.randn(*shape, generator=g) for name, (shape, _, _) in PARAMS.items()}
    grads = [{name: torch.randn(*shape, generator=g) for name, (shape, _, _) in PARAMS.items()} for _ in range(STEPS)]
    return init, grads


def run(
    tp_rank: int | None, group: dist.ProcessGroup | None, max_norm: float
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train STEPS steps on shards of rank ``tp_rank`` (None: the full tensors, no TP)."""
    init, grads = full_tensors(seed=0)
    params: dict[str, nn.Parameter] = {}
    for name, full in init.items():
        p = nn.Parameter(full.clone() if tp_rank is None else shard(name, full, tp_rank))
        _, dim, stride = PARAMS[name]
        if tp_rank is not None and dim is not None:  # what set_tensor_model_parallel_attributes does
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride  # type: ignore[attr-defined]
        params[name] = p
    config = HybridOptimizerConfig(
        lr=0.01,
        weight_decay=0.1,
        split_gated_fc1=True,
        newton_schulz=NewtonSchulzConfig(schedule="polar_express", steps=6),
    )
    # Layer 1 uses the other settings: fc1 fused (the stride-2 gather must still rebuild the
    # global row order) and QKV split per kind; it gets its own optimizer.
    layer1 = ["decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.1.self_attention.linear_qkv.weight"]
    main = build_optimizer(
        params.items(), config, qkv_layout=LAYOUT, tp_group=group, route=lambda n, p: "exclude" if n in layer1 else None
    )
    config1 = HybridOptimizerConfig(
        lr=0.01, weight_decay=0.1, newton_schulz=config.newton_schulz, qkv_split_mode="per_kind"
    )
    extra = build_optimizer([(n, params[n]) for n in layer1], config1, qkv_layout=LAYOUT, tp_group=group)
    norms = []
    for step in range(STEPS):
        for name, p in params.items():
            full = grads[step][name]
            p.grad = full.clone() if tp_rank is None else shard(name, full, tp_rank)
        norms.append(float(main.clip_grad_norm_(max_norm)))
        main.step()
        extra.step()
    return {name: p.detach().clone() for name, p in params.items()}, norms


MAX_NORMS = (1e9, 5.0)  # 1e9 never clips (coefficient exactly 1); 5.0 clips every step


def worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, WORLD, port)
    results = {max_norm: run(rank, dist.group.WORLD, max_norm) for max_norm in MAX_NORMS}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_group()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Per TP rank: {max_norm: (params, norms)} from two spawned gloo processes."""
    tmp = tmp_path_factory.mktemp("tp")
    spawn(worker, (str(tmp),), nprocs=WORLD)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference() -> dict[float, tuple[dict[str, torch.Tensor], list[float]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {max_norm: run(None, None, max_norm) for max_norm in MAX_NORMS}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_sharded_update_equals_single_process_bitwise(sharded: list[dict], reference: dict) -> None:
    expected, expected_norms = reference[1e9]
    for rank, result in enumerate(sharded):
        params, norms = result[1e9]
        for name, full in expected.items():
            assert torch.equal(params[name], shard(name, full, rank)), f"rank {rank}: {name} differs"
        assert norms == pytest.approx(expected_norms, rel=1e-6)
    init, _ = full_tensors(seed=0)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(expected[qkv], init[qkv])  # something was trained


@pytest.mark.slow
def test_sharded_clipping_matches_single_process(sharded: list[dict], reference: dict) -> None:
    expected, expected_norms = reference[5.0]
    assert expected_norms[0] > 5.0  # the clip is active
    for rank, result in enumerate(sharded):
        params, norms = result[5.0]
        assert norms == pytest.approx(expected_norms, rel=1e-6)
        for name, full in expected.items():
            torch.testing.assert_close(params[name], shard(name, full, rank), atol=1e-6, rtol=0)
