"""The trainer's Megatron-core MoE policies compute transformers' log-probs, and the sidecar's after
an export → push; the bridge is exact both ways at TP 1, TP 2 and EP 2 (DESIGN invariant 2 for MoE).

Oracle: transformers' `Qwen3MoeForCausalLM` and `Glm4MoeForCausalLM` on the checkpoints their
`save_pretrained` writes (`tests/sidecar/model/test_moe_models.py` and `test_glm_moe.py` build them: decisive
routers, random expert-score biases, a dense layer, shared experts, partial rotary). The sidecar
starts from other weights of the same shape, so only the push can make its log-probs the trainer's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from muon import HybridOptimizerConfig
from sidecar.client.client import SidecarClient
from sidecar.model.checkpoint import load_checkpoint, save_checkpoint
from sidecar.model.model import build_model
from sidecar.types import ScoreRequest
from tests.sidecar.model.test_glm_moe import add_native_mtp_layer, hf_glm
from tests.sidecar.model.test_moe_models import VARIANTS, hf_qwen3_moe
from tests.sidecar_fixtures import start_sidecar
from tests.spawn_workers import join_group, leave_group, spawn
from trainer.draft.objective import DraftConfig
from trainer.policy.policy import Policy, TrainBatch

pytestmark = pytest.mark.usefixtures("single_torch_thread")

VOCAB = 96
CASES: dict[str, Callable[[Path], Any]] = {
    **{f"qwen3moe-{v}": (lambda path, v=v: hf_qwen3_moe(path, **VARIANTS[v])[0]) for v in VARIANTS},
    "glm45": lambda path: hf_glm(path, attention_bias=True, use_qk_norm=False),
    "glm45-qk_norm": lambda path: hf_glm(path, use_qk_norm=True),
}


def tokens(batch: int = 2, seq: int = 40, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logprobs(hf: Any, ids: torch.Tensor) -> torch.Tensor:  # (B, S) -> (B, S-1)
    with torch.no_grad():
        logits = hf(ids).logits.float()
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path]:
    path = tmp_path_factory.mktemp(request.param)
    return request.param, CASES[request.param](path), path


def test_the_policys_logprobs_are_transformers_and_import_export_is_the_identity(case: tuple[str, Any, Path]) -> None:
    _, hf, path = case
    config, tensors = load_checkpoint(path)
    policy = Policy(config, Policy.Config(), tensors)
    ids = tokens()
    torch.testing.assert_close(policy.logprobs(ids), hf_logprobs(hf, ids), rtol=0, atol=1e-4)
    exported = dict(policy.export_named_tensors())
    assert list(exported) == policy.export_names()
    assert exported.keys() == tensors.keys()  # every expert, router and bias under the checkpoint's names
    for name, tensor in tensors.items():
        assert torch.equal(exported[name], tensor), name
    assert exported[next(n for n in exported if n.endswith("mlp.gate.weight"))].dtype == torch.float32


def other_weights(path: Path, out: Path, seed: int = 11) -> Path:
    """The same model with other weights (every tensor moved), where the sidecar starts."""
    config, tensors = load_checkpoint(path)
    gen = torch.Generator().manual_seed(seed)
    save_checkpoint(out, config, {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in tensors.items()})
    return out


@pytest.mark.parametrize("name", ["qwen3moe-mlp_only_layers", "glm45"])
def test_the_sidecars_logprobs_after_export_and_push_are_the_trainers(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, name: str
) -> None:
    hf = CASES[name](tmp_path / "model")
    config, tensors = load_checkpoint(tmp_path / "model")
    policy = Policy(config, Policy.Config(), tensors)
    ids = tokens(seq=50)
    got = policy.logprobs(ids)
    torch.testing.assert_close(got, hf_logprobs(hf, ids), rtol=0, atol=1e-4)
    request = ScoreRequest(sequences=ids.tolist(), start_indices=[1, 1])
    other = other_weights(tmp_path / "model", tmp_path / "other")
    with start_sidecar(other, speculation_k=0) as sc, SidecarClient(sc.address) as c:
        before = torch.tensor(c.score(request).logprobs)
        assert (before - got).abs().max() > 1e-2  # the test can fail: other weights before the push
        c.push_weights(dict(policy.export_named_tensors()), version=1)
        served = torch.tensor(c.score(request).logprobs)
    torch.testing.assert_close(served, got, rtol=0, atol=1e-4)


def test_glms_own_mtp_layer_is_the_draft_the_trainer_trains(tmp_path: Path) -> None:
    """The checkpoint's MTP layer (a sparse layer itself) is the engine's draft, in the trainer."""

    hf_glm(tmp_path, attention_bias=True, use_qk_norm=False)
    add_native_mtp_layer(tmp_path)
    config, tensors = load_checkpoint(tmp_path)
    assert config.num_nextn_predict_layers == 1 and any(".mlp.experts." in n for n in tensors if n.startswith("mtp."))
    policy = Policy(config, Policy.Config(), tensors)
    engine = build_model(config)
    engine.load_state_dict(tensors, strict=True)
    ids = tokens()
    with torch.no_grad():
        want = engine.mtp_logits(ids, engine.hidden_states(ids))
    torch.testing.assert_close(policy.draft_logits(ids), want, rtol=0, atol=1e-4)
    assert sorted(policy.export_names()) == sorted(tensors)
    policy.train_step(TrainBatch(tokens=ids, mask=torch.ones(2, 39), advantages=torch.tensor([1.0, -1.0])))
    exported = dict(policy.export_named_tensors())
    moved = [
        n for n in exported if n.startswith("mtp.layers.0.mlp.experts.") and not torch.equal(exported[n], tensors[n])
    ]
    assert moved  # the draft's experts trained


# ---- tensor and expert parallel (two gloo processes) -----------------------------------------


def _config(**layout: int) -> Policy.Config:
    fast = HybridOptimizerConfig(lr=1e-2, weight_decay=0.0)
    return Policy.Config(optimizer=fast, draft=DraftConfig(optimizer=fast), **layout)


def _train(policy: Policy) -> dict[str, torch.Tensor]:
    """Two updates at lr 1e-2 on a fixed batch (a wrong gradient sum or norm moves weights by ~1e-2)."""
    ids = tokens(batch=4, seq=24, seed=8)
    for _ in range(2):
        policy.train_step(
            TrainBatch(tokens=ids, mask=torch.ones(4, 23), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
        )
    return dict(policy.export_named_tensors())


def _worker(rank: int, port: int, mode: str, ckpt: str, out: str) -> None:
    join_group(rank, 2, port)
    config, tensors = load_checkpoint(ckpt)
    policy = Policy(
        config, _config(tensor_parallel=2) if mode == "tp2" else _config(data_parallel=2, expert_parallel=2), tensors
    )
    result: dict[str, Any] = {"exported": dict(policy.export_named_tensors()), "names": policy.export_names()}
    result["logprobs"] = policy.logprobs(tokens())
    if mode == "ep2":
        params = dict(policy.model.named_parameters())
        result["local"] = sorted(n for n in params if "local_experts" in n)
        assert all(not getattr(params[n], "allreduce", True) for n in result["local"])  # Megatron's EP mark
    if mode == "tp2":
        with pytest.raises(ValueError, match="sequence parallelism"):  # Megatron refuses it; said so first
            _train(policy)
    else:
        result["after"] = _train(policy)
    torch.save(result, f"{out}.{rank}")
    leave_group()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3moe-mlp_only_layers", "glm45"])
@pytest.mark.parametrize("mode", ["tp2", "ep2"])
def test_two_processes_export_every_tensor_and_train_like_one_process(tmp_path: Path, name: str, mode: str) -> None:
    """tp2: attention, dense MLPs, experts and shared experts sharded over two ranks; ep2: each rank
    holds half the experts (Megatron's allgather dispatcher, the one that runs on gloo) and trains
    half the rows (data parallel 2). Exports are exact, log-probs transformers', and (ep2) two
    updates equal one process's; training under tp2 is refused (Megatron wants sequence parallelism)."""
    hf = CASES[name](tmp_path / "model")
    out = tmp_path / "result"
    spawn(_worker, (mode, str(tmp_path / "model"), str(out)), nprocs=2)
    _, tensors = load_checkpoint(tmp_path / "model")
    want = hf_logprobs(hf, tokens())
    results = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    config, tensors = load_checkpoint(tmp_path / "model")
    one = _train(Policy(config, _config(), tensors)) if mode == "ep2" else {}
    for result in results:
        assert result["exported"].keys() == tensors.keys()
        assert list(result["exported"]) == result["names"]
        for n, tensor in tensors.items():
            assert torch.equal(result["exported"][n], tensor), n
        torch.testing.assert_close(result["logprobs"], want, rtol=0, atol=1e-4)
        # k_proj.bias is left out: its gradient is 0 in exact arithmetic (softmax ignores q·b_k, the same
        # for every key), so AdamW's first step is lr times the sign of rounding noise, which a
        # two-replica sum rounds otherwise (measured: 3e-3 apart; every other tensor within 6e-7)
        if mode == "ep2":  # the test can fail: the updates moved the weights by ~1e-2
            assert sum(bool((t - tensors[n]).abs().max() > 1e-3) for n, t in one.items()) > len(one) // 2
        for n, tensor in one.items() if mode == "ep2" else ():
            if n.endswith("k_proj.bias"):
                continue
            torch.testing.assert_close(result["after"][n], tensor, rtol=0, atol=2e-5, msg=n)
    if mode == "ep2":
        experts = load_checkpoint(tmp_path / "model")[0].moe
        assert experts is not None
        per_layer = experts.num_experts // 2
        assert results[0]["local"] == results[1]["local"]  # local slots 0..E/2-1 on each rank
        assert max(int(n.split("local_experts.")[1].split(".")[0]) for n in results[0]["local"]) == per_layer - 1


def test_the_preflight_names_what_an_moe_run_needs(tmp_path: Path) -> None:
    """Before anything is built: an expert-parallel size that divides the experts and the processes;
    routing replay only on an MoE policy; and an MoE checkpoint is no longer refused."""
    from sidecar.model.checkpoint import model_state_dict
    from sidecar.model.model import ModelConfig
    from sidecar.model.moe import MoEConfig
    from trainer.cli.commands import resolve_config
    from trainer.rl.preflight import PreflightError, preflight

    def checkpoint(path: Path, experts: MoEConfig | None) -> Path:
        arch = ["Qwen3MoeForCausalLM"] if experts is not None else ["Qwen3ForCausalLM"]
        config = ModelConfig.tiny(vocab_size=128, max_position_embeddings=256, architectures=arch, moe=experts)
        save_checkpoint(path, config, model_state_dict(build_model(config, seed=0)))
        return path

    sparse = checkpoint(tmp_path / "moe", MoEConfig(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32))
    dense = checkpoint(tmp_path / "dense", None)

    def check(model: Path, *overrides: str) -> None:
        preflight(resolve_config(None, [f"model={model}", "sidecars.local=1", *overrides]), probe_sidecars=False)

    check(sparse, "algorithm.routing_replay=rollout")  # accepted: replay on an MoE served by the torch engine
    with pytest.raises(PreflightError, match=r"num_experts=6 is not divisible by expert_parallel=4"):
        check(sparse, "train.expert_parallel=4", "train.data_parallel=4")
    with pytest.raises(PreflightError, match=r"train.expert_parallel=2 must divide the 1 processes"):
        check(sparse, "train.expert_parallel=2")
    with pytest.raises(PreflightError, match=r"routing_replay='rollout' but model=.* is dense"):
        check(dense, "algorithm.routing_replay=rollout")
    with pytest.raises(PreflightError, match=r"expert_parallel=2 but model=.* is dense"):
        check(dense, "train.expert_parallel=2", "train.data_parallel=2")
    with pytest.raises(Exception, match="routing_replay must be one of"):  # the CLI refuses the value
        check(sparse, "algorithm.routing_replay=sampler")


def test_tools_bench_moe_trainer_runs_both_policies(capsys: pytest.CaptureFixture[str]) -> None:
    """tools/bench/moe_trainer.py (docs/moe.md's trainer step figures) at its smallest, with replay."""
    from tools.bench import moe_trainer as tool

    assert tool.main(["--rows", "2", "--seq", "8", "--repeats", "1", "--replay"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| 2 x 8 |") and row.endswith("| on |")
