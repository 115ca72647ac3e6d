"""Checkpoint bridge: HF -> Megatron -> HF is exact; tensor parallel 2 exports what TP 1 exports.

The two-process tests spawn gloo workers (127.0.0.1, free port, with a deadline) that load the
same checkpoint at tensor parallel 2 (or data parallel 2, one sample per replica), export, compute
log-probs and take two training steps; the parent does the same in one process and compares.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from muon import HybridOptimizerConfig
from sidecar.model.checkpoint import load_checkpoint, model_state_dict, save_checkpoint
from sidecar.model.eagle3 import Eagle3Config
from sidecar.model.model import ModelConfig, build_model
from tests.spawn_workers import join_group, leave_group, spawn
from trainer.draft.objective import DraftConfig
from trainer.policy import bridge
from trainer.policy.policy import Policy, TrainBatch


def _state(mc: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    state = model_state_dict(build_model(mc, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.1 * torch.randn(v.shape, generator=gen) if k.endswith("norm.weight") else v for k, v in state.items()
    }


FAMILIES = ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"]


@pytest.mark.parametrize("architecture", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_hf_megatron_hf_round_trip_is_exact(tied: bool, architecture: str) -> None:
    mc = ModelConfig.tiny(tie_word_embeddings=tied, architectures=[architecture])
    state = _state(mc, seed=7)
    policy = Policy(mc, Policy.Config(), dict(state))
    exported = list(policy.export_named_tensors())
    names = [n for n, _ in exported]
    assert len(names) == len(set(names)) and set(names) == set(state)
    assert policy.export_names() == names  # a streamed push announces them before any tensor
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
    params = dict(policy.model.named_parameters())
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in params) == mc.qk_norm
    if mc.attention_bias:  # Megatron's add_qkv_bias: the bias fused per group like the weight
        bias = params["decoder.layers.1.self_attention.linear_qkv.bias"][(heads_per_group + 2) * d :][
            : (heads_per_group + 2) * d
        ]
        assert torch.equal(bias[-d:], state["model.layers.1.self_attn.v_proj.bias"][d:])
        assert torch.equal(
            bias[: heads_per_group * d], state["model.layers.1.self_attn.q_proj.bias"][heads_per_group * d :]
        )
    else:
        assert not any(n.endswith("bias") for n in params)


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


def _run(policy: Policy, mc: ModelConfig, rows: slice) -> dict[str, object]:
    """Export, log-probs, then two training steps on `rows` of a fixed batch (equal token counts)."""
    tokens = torch.randint(0, mc.vocab_size, (2, 20), generator=torch.Generator().manual_seed(4))
    mask = torch.zeros(2, 19)
    mask[:, 5:] = 1.0
    batch = TrainBatch(tokens=tokens[rows], mask=mask[rows], advantages=torch.tensor([1.0, -1.0])[rows])
    exported = dict(policy.export_named_tensors())
    logprobs = policy.logprobs(batch.tokens)
    for _ in range(2):
        policy.train_step(batch)
    return {"exported": exported, "logprobs": logprobs, "after": dict(policy.export_named_tensors())}


def _config(tp: int, dp: int = 1) -> Policy.Config:
    # adamw_eps above the gradients' rounding floor: a k bias's lowest-frequency rotary component has a
    # gradient near zero (its rotation over 20 positions is ~1e-4 rad, so it shifts every score of a query
    # almost alike), and AdamW at eps 1e-8 divides that element's rounding noise by its own size, turning
    # the sharded-vs-unsharded summation order into a ±lr update (seen as a 3e-4 gap on one CPU). At 1e-6
    # such an element moves by lr·g/eps, its noise ~1e-6; elements with gradients well above 1e-6 move as before.
    fast = HybridOptimizerConfig(lr=1e-2, weight_decay=0.0, adamw_eps=1e-6)
    return Policy.Config(tensor_parallel=tp, data_parallel=dp, optimizer=fast, draft=DraftConfig(optimizer=fast))


def _worker(rank: int, port: int, mode: str, ckpt: str, out: str) -> None:
    join_group(rank, 2, port)
    mc, tensors = load_checkpoint(ckpt)
    if mode.startswith("tp2") and mode != "tp2-eagle3":  # both ranks see the whole batch; the model is sharded
        result = _run(Policy(mc, _config(2), tensors), mc, slice(None))
    elif mode == "tp2-eagle3":  # the same, training an EAGLE-3 draft (replicated) on the sharded trunk's taps
        result = _run(Policy(mc, _config(2), tensors, eagle3=_eagle3(mc)), mc, slice(None))
    else:  # dp2: whole model on each rank, each replica trains one of the two samples
        result = _run(Policy(mc, _config(1, dp=2), tensors), mc, slice(None))
    if rank == 0:
        torch.save(result, out)
    leave_group()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tp2", "dp2", "tp2-qwen2"])
def test_two_processes_export_and_train_like_one(tmp_path: Path, mode: str) -> None:
    """tp2-qwen2: the q/k/v biases sharded with their projection's rows."""
    mc = ModelConfig.tiny(architectures=["Qwen2ForCausalLM"] if mode == "tp2-qwen2" else ["Qwen3ForCausalLM"])
    state = _state(mc, seed=9)
    save_checkpoint(tmp_path / "ckpt", mc, state)
    out = tmp_path / "rank0.pt"
    spawn(_worker, (mode, str(tmp_path / "ckpt"), str(out)), nprocs=2)
    two = torch.load(out, weights_only=True)

    mc1, tensors = load_checkpoint(tmp_path / "ckpt")
    one = _run(Policy(mc1, _config(1), tensors), mc1, slice(None))
    assert two["exported"].keys() == one["exported"].keys() == state.keys()
    for name, tensor in two["exported"].items():
        assert torch.equal(tensor, one["exported"][name]), name  # gathered shards == unsharded, exactly
    torch.testing.assert_close(two["logprobs"], one["logprobs"], rtol=0, atol=1e-5)
    # Two Muon/AdamW steps at lr 1e-2: each tensor's update equals the one process's to 1e-3 of its norm
    # (measured: <= 1e-4); a wrong gradient reduction changes an update's direction, O(1) of its norm.
    # Element-wise bounds cannot hold: AdamW maps an element whose gradient sits near its rounding floor
    # to about ±lr·g/eps whatever the summation order made of it.
    for name, tensor in two["after"].items():
        update_one = one["after"][name] - one["exported"][name]
        update_two = tensor - two["exported"][name]
        gap = (update_two - update_one).norm() / update_one.norm().clamp_min(1e-12)
        assert gap <= 1e-3, (name, gap.item())


def _eagle3(mc: ModelConfig) -> Eagle3Config:
    return Eagle3Config.for_target(mc, aux_layer_ids=[1, 2, 3])


@pytest.mark.slow
def test_two_tensor_parallel_ranks_train_an_eagle3_draft_like_one_process(tmp_path: Path) -> None:
    mc = ModelConfig.tiny(num_hidden_layers=4, num_nextn_predict_layers=0)
    save_checkpoint(tmp_path / "ckpt", mc, _state(mc, seed=9))
    out = tmp_path / "rank0.pt"
    spawn(_worker, ("tp2-eagle3", str(tmp_path / "ckpt"), str(out)), nprocs=2)
    two = torch.load(out, weights_only=True)
    mc1, tensors = load_checkpoint(tmp_path / "ckpt")
    one = _run(Policy(mc1, _config(1), tensors, eagle3=_eagle3(mc1)), mc1, slice(None))
    assert two["after"].keys() == one["after"].keys() and any(n.startswith("eagle3.") for n in one["after"])
    for name, tensor in two["after"].items():  # trunk and draft after two steps
        assert not torch.equal(tensor, one["exported"][name]) or "norm" in name, name  # it trained
        torch.testing.assert_close(tensor, one["after"][name], rtol=0, atol=2e-5, msg=name)
