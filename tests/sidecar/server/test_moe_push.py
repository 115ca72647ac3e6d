"""Pushes of mixture-of-experts weights (issue 58): router, experts, a dense layer among sparse ones,
on every transport, in full and as sparse deltas.

Oracle: a fresh engine loaded from a checkpoint of the pushed weights (its greedy output and its
parameters), and the sender's own copy of the weights. A push holding a NaN in one expert's tensor
is refused naming it, nothing applied.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest
import torch

from sidecar.client.client import SidecarCallError
from sidecar.engine.torch_engine import TorchEngine
from sidecar.errors import WeightMismatchError
from sidecar.model.checkpoint import model_state_dict, save_checkpoint, target_tensor_names
from sidecar.model.model import ModelConfig, build_model
from sidecar.model.moe import MoEConfig
from sidecar.types import GenerationRequest, SamplingParams, WeightSelector, WeightTransport
from tests.sidecar.weight_transport.test_weight_delta import delta_client, served, sha, sparse_step
from tests.sidecar_fixtures import TRANSPORTS, greedy_tokens, start_sidecar

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9]]
NEW = 8


def moe_config() -> ModelConfig:
    moe = MoEConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[0]
    )
    return ModelConfig.tiny(max_position_embeddings=256, architectures=["Qwen3MoeForCausalLM"], moe=moe)


def moe_weights(seed: int) -> dict[str, torch.Tensor]:
    model = build_model(moe_config(), seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(4.0)  # decisive routing: a changed router changes the output
    return {n: t.clone() for n, t in model_state_dict(model).items()}


def fresh_greedy(tmp_path: Path, state: dict[str, torch.Tensor]) -> list[list[int]]:
    """Greedy decoding of an engine loaded afresh from a checkpoint of `state`."""
    path = tmp_path / f"fresh-{sha(state)[:8]}"
    save_checkpoint(path, moe_config(), state)
    engine = TorchEngine.from_checkpoint(path)
    req = GenerationRequest(prompts=PROMPTS, sampling=SamplingParams(temperature=0.0, max_new_tokens=NEW))
    return [s.token_ids for s in engine.generate(req)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "ckpt"
    save_checkpoint(path, moe_config(), moe_weights(0))
    return path


def test_the_contract_names_the_experts_and_nothing_else_changes_for_dense_layers() -> None:
    names = target_tensor_names(moe_config())
    assert "model.layers.0.mlp.gate_proj.weight" in names  # layer 0 is dense (mlp_only_layers)
    assert "model.layers.1.mlp.gate.weight" in names and "model.layers.1.mlp.gate_proj.weight" not in names
    assert {f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)} <= set(names)
    assert target_tensor_names(ModelConfig.tiny()) == target_tensor_names(
        dataclasses.replace(moe_config(), moe=None, architectures=["Qwen3ForCausalLM"])
    )


@pytest.mark.parametrize("transport", list(TRANSPORTS), ids=lambda t: t.value)
def test_moe_pushes_full_and_sparse_equal_a_fresh_load(checkpoint: Path, tmp_path: Path, transport: WeightTransport):
    g = torch.Generator().manual_seed(7)
    first = moe_weights(1)
    expected = fresh_greedy(tmp_path, first)
    assert expected != fresh_greedy(tmp_path, moe_weights(0))  # the test can fail
    with start_sidecar(checkpoint) as sc, delta_client(sc.address, transport) as c:
        model = c.info().engine.model  # GetInfo names the experts
        assert (model.architecture, model.num_experts, model.num_experts_per_tok) == ("Qwen3MoeForCausalLM", 4, 2)
        assert (model.router, model.num_sparse_layers) == ("softmax_topk", 1)
        assert c.push_weights(first, version=1).transport is transport
        assert served(sc) == (1, sha(first))
        assert greedy_tokens(c, PROMPTS, NEW) == expected
        state = first
        for v in (2, 3):  # sparse deltas touching the experts and routers only
            moved = sparse_step({n: t for n, t in state.items() if ".mlp.gate." in n or ".experts." in n}, g, 0.05)
            state = state | moved
            result = c.push_weights(state, version=v)
            assert result.bytes_received * 4 < sum(t.numel() * 4 for t in state.values())  # deltas were sent
        assert served(sc) == (3, sha(state))
        assert greedy_tokens(c, PROMPTS, NEW) == fresh_greedy(tmp_path, state)


def test_a_nan_in_one_expert_is_refused_and_nothing_applies(checkpoint: Path) -> None:
    state = moe_weights(1)
    bad = {n: t.clone() for n, t in state.items()}
    bad["model.layers.1.mlp.experts.3.down_proj.weight"][2, 5] = float("nan")
    with start_sidecar(checkpoint) as sc, delta_client(sc.address) as c:
        before = served(sc)
        with pytest.raises(SidecarCallError) as err:
            c.push_weights(bad, version=1)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in err.value.details
        assert served(sc) == before
        c.push_weights(state, version=1)
        assert served(sc) == (1, sha(state))


def test_routers_are_float32_in_a_bfloat16_model(tmp_path: Path) -> None:
    """Stored, served and pushed in float32 (`checkpoint.ROUTER_SUFFIXES`): a bf16 model's routing
    choices are not made on bf16-rounded router weights."""
    config = dataclasses.replace(moe_config(), torch_dtype="bfloat16")
    state = {
        n: t.to(torch.float32 if n.endswith(".mlp.gate.weight") else torch.bfloat16) for n, t in moe_weights(1).items()
    }
    save_checkpoint(tmp_path, config, state)
    engine = TorchEngine.from_checkpoint(tmp_path)
    router = "model.layers.1.mlp.gate.weight"
    specs = {s.name: s.dtype for s in engine.weight_specs(WeightSelector.ALL)}
    assert specs[router] == torch.float32 and specs["model.layers.1.mlp.experts.0.up_proj.weight"] == torch.bfloat16
    assert dict(engine.model.named_parameters())[router].dtype == torch.float32
    assert torch.equal(dict(engine.model.named_parameters())[router], state[router])  # not rounded on the way
    with pytest.raises(WeightMismatchError, match="float32"):
        engine.update_weights(state | {router: state[router].bfloat16()}, WeightSelector.ALL, version=1)
    engine.update_weights(state, WeightSelector.ALL, version=1)
