"""Checkpoint bridge: HF -> Megatron -> HF is exact; tensor parallel 2 exports what TP 1 exports.

The TP test spawns two gloo processes (127.0.0.1, free port, with a deadline) that load the same
checkpoint at TP 2, export, compute log-probs and take two training steps; the parent does the
same at TP 1 and compares.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from muon import HybridOptimizerConfig
from sidecar.engine.checkpoint import load_checkpoint, model_state_dict, save_checkpoint
from sidecar.engine.model import ModelConfig, build_model
from trainer import bridge, platform
from trainer.policy import Policy, TrainBatch


def _state(mc: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    state = model_state_dict(build_model(mc, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.1 * torch.randn(v.shape, generator=gen) if k.endswith("norm.weight") else v for k, v in state.items()
    }


@pytest.mark.parametrize("tied", [False, True])
def test_hf_megatron_hf_round_trip_is_exact(tied: bool) -> None:
    mc = ModelConfig.tiny(tie_word_embeddings=tied)
    state = _state(mc, seed=7)
    policy = Policy(mc, Policy.Config(), dict(state))
    exported = list(policy.export_named_tensors())
    names = [n for n, _ in exported]
    assert len(names) == len(set(names)) and set(names) == set(state)
    for name, tensor in exported:
        assert torch.equal(tensor, state[name]), name
    # The fused layout is Megatron's: q heads of a group, then its k, then its v.
    heads_per_group, d = mc.num_attention_heads // mc.num_key_value_heads, mc.head_dim
    qkv = dict(policy.model.named_parameters())["decoder.layers.1.self_attention.linear_qkv.weight"]
    g1 = qkv[(heads_per_group + 2) * d : 2 * (heads_per_group + 2) * d]  # query group 1
    assert torch.equal(
        g1[: heads_per_group * d], state["model.layers.1.self_attn.q_proj.weight"][heads_per_group * d :]
    )
    assert torch.equal(g1[heads_per_group * d : -d], state["model.layers.1.self_attn.k_proj.weight"][d:])
    assert torch.equal(g1[-d:], state["model.layers.1.self_attn.v_proj.weight"][d:])


def test_load_rejects_mismatched_checkpoints() -> None:
    mc = ModelConfig.tiny()
    state = _state(mc, seed=1)
    policy = Policy(mc, Policy.Config(), dict(state))
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(bridge.CheckpointMismatchError, match=r"model\.norm\.weight"):
        policy.load_tensors(missing)
    bad = dict(state)
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"][:, :-1]
    with pytest.raises((bridge.CheckpointMismatchError, RuntimeError)):
        policy.load_tensors(bad)


def _tokens(mc: ModelConfig) -> torch.Tensor:
    return torch.randint(0, mc.vocab_size, (2, 20), generator=torch.Generator().manual_seed(4))


def _run(policy: Policy, mc: ModelConfig) -> dict[str, object]:
    tokens = _tokens(mc)
    mask = torch.zeros(2, 19)
    mask[:, 5:] = 1.0
    batch = TrainBatch(tokens=tokens, mask=mask, advantages=torch.tensor([1.0, -1.0]))
    exported = dict(policy.export_named_tensors())
    logprobs = policy.logprobs(tokens)
    for _ in range(2):
        policy.train_step(batch)
    return {"exported": exported, "logprobs": logprobs, "after": dict(policy.export_named_tensors())}


def _config(tp: int) -> Policy.Config:
    fast = HybridOptimizerConfig(lr=1e-2, weight_decay=0.0)
    return Policy.Config(tensor_parallel=tp, optimizer=fast, draft_optimizer=fast)


def _tp_worker(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    platform.init_distributed(rank=rank, world_size=world, port=port)
    try:
        mc, tensors = load_checkpoint(ckpt)
        result = _run(Policy(mc, _config(world), tensors), mc)
        if rank == 0:
            torch.save(result, out)
    finally:
        platform.teardown()


@pytest.mark.slow
def test_tensor_parallel_2_exports_and_trains_like_tp_1(tmp_path: Path) -> None:
    mc = ModelConfig.tiny()
    state = _state(mc, seed=9)
    save_checkpoint(tmp_path / "ckpt", mc, state)
    out = tmp_path / "tp2.pt"
    ctx = mp.start_processes(
        _tp_worker,
        args=(2, platform.free_port(), str(tmp_path / "ckpt"), str(out)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("TP=2 workers did not finish within 180 s")
    tp2 = torch.load(out, weights_only=True)

    mc1, tensors = load_checkpoint(tmp_path / "ckpt")
    tp1 = _run(Policy(mc1, _config(1), tensors), mc1)
    assert tp2["exported"].keys() == tp1["exported"].keys() == state.keys()
    for name, tensor in tp2["exported"].items():
        assert torch.equal(tensor, tp1["exported"][name]), name  # gathered shards == unsharded, exactly
    torch.testing.assert_close(tp2["logprobs"], tp1["logprobs"], rtol=0, atol=1e-5)
    # Two Muon/AdamW steps at lr 1e-2: a wrong TP gradient reduction would move weights by ~1e-2.
    for name, tensor in tp2["after"].items():
        torch.testing.assert_close(tensor, tp1["after"][name], rtol=0, atol=2e-5, msg=name)
